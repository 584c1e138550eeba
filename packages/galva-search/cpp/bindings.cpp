// Python bindings of the search core. The algorithms live in plain C++ headers beside this file.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_core, m) {
  m.doc() = "galva-search C++ core";
  m.attr("__version__") = "0.1.0";
}
