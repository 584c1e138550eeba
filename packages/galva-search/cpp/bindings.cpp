// Python bindings of the search core. The algorithm lives in stage_dp.hpp (plain C++17, no Python).
// Arrays arrive as flat float64 buffers (numpy arrays or array.array('d')); shapes are checked in galva_search.dp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "stage_dp.hpp"
#include "stage_levels.hpp"

namespace py = pybind11;
using galva::dp::LevelCounts;
using galva::dp::Options;
using galva::dp::StageLevels;
using galva::dp::StageProblem;
using galva::dp::StageSolution;
using galva::dp::Stats;

namespace {

std::vector<double> copy_buffer(const py::buffer& buf, const char* name) {
  py::buffer_info info = buf.request();
  if (info.format != py::format_descriptor<double>::format() || info.itemsize != sizeof(double))
    throw py::value_error(std::string(name) + " must be a float64 buffer");
  if (info.ndim != 1 || (info.ndim == 1 && info.strides[0] != static_cast<py::ssize_t>(sizeof(double))))
    throw py::value_error(std::string(name) + " must be a contiguous 1-d buffer");
  const double* data = static_cast<const double*>(info.ptr);
  return std::vector<double>(data, data + info.size);
}

StageProblem make_problem(int layers, int strategies, const py::buffer& intra, const py::buffer& memory,
                          const py::buffer& inter, double budget) {
  StageProblem p;
  p.layers = layers;
  p.strategies = strategies;
  p.intra = copy_buffer(intra, "intra_time");
  p.memory = copy_buffer(memory, "memory_mib");
  p.inter = copy_buffer(inter, "inter_time");
  p.budget = budget;
  return p;
}

Options make_options(double memory_resolution, bool prune_strategies, bool use_bounds) {
  Options o;
  o.memory_resolution = memory_resolution;
  o.prune_strategies = prune_strategies;  // dominance: between strategies (step 1) and across fronts (step 3)
  o.cross_prune = prune_strategies;
  o.use_bounds = use_bounds;
  return o;
}

py::object to_python(const StageSolution& s) {
  if (!s.feasible) return py::none();
  return py::make_tuple(py::tuple(py::cast(s.choice)), s.time, s.memory);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "galva-search C++ core: exact per-stage strategy DP (see stage_dp.hpp)";
  m.attr("__version__") = "0.1.0";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def(
      "solve_stage",
      [](int layers, int strategies, const py::buffer& intra, const py::buffer& memory, const py::buffer& inter,
         double budget, double memory_resolution, bool prune_strategies, bool use_bounds) {
        StageProblem p = make_problem(layers, strategies, intra, memory, inter, budget);
        const Options o = make_options(memory_resolution, prune_strategies, use_bounds);
        StageSolution s;
        Stats st;
        {
          py::gil_scoped_release release;
          s = galva::dp::solve(p, o, &st);
        }
        py::dict stats;
        stats["method"] = st.method;
        stats["front_points"] = st.front_points;
        stats["max_front"] = st.max_front;
        stats["dual_passes"] = st.dual_passes;
        stats["live_strategies"] = st.live_strategies;
        stats["cross_pruned"] = st.cross_pruned;
        return py::make_tuple(to_python(s), stats);
      },
      py::arg("layers"), py::arg("strategies"), py::arg("intra"), py::arg("memory"), py::arg("inter"),
      py::arg("budget"), py::arg("memory_resolution") = 0.0, py::arg("prune_strategies") = true,
      py::arg("use_bounds") = true,
      "Solve one stage. Returns ((choice, time, memory) or None, stats dict). Releases the GIL.");

  m.def(
      "solve_many",
      [](const py::list& problems, unsigned threads, double memory_resolution, bool prune_strategies,
         bool use_bounds) {
        std::vector<StageProblem> ps;
        ps.reserve(problems.size());
        for (const py::handle& h : problems) {
          const py::tuple t = h.cast<py::tuple>();
          if (t.size() != 6) throw py::value_error("each problem is (layers, strategies, intra, memory, inter, budget)");
          ps.push_back(make_problem(t[0].cast<int>(), t[1].cast<int>(), t[2].cast<py::buffer>(),
                                    t[3].cast<py::buffer>(), t[4].cast<py::buffer>(), t[5].cast<double>()));
        }
        const Options o = make_options(memory_resolution, prune_strategies, use_bounds);
        std::vector<StageSolution> out;
        {
          py::gil_scoped_release release;
          out = galva::dp::solve_many(ps, o, threads);
        }
        py::list result;
        for (const StageSolution& s : out) result.append(to_python(s));
        return result;
      },
      py::arg("problems"), py::arg("threads") = 0, py::arg("memory_resolution") = 0.0,
      py::arg("prune_strategies") = true, py::arg("use_bounds") = true,
      "Solve independent stages on C++ threads (0 = one per hardware thread) with the GIL released.");

  py::class_<StageLevels>(m, "StageLevels",
                          "One stage's transient levels, reduced and bounded, with their solutions (stage_levels.hpp)")
      .def(py::init([](int layers, int strategies, const py::buffer& intra, const py::buffer& memory,
                       const py::buffer& inter, const py::buffer& transient, std::vector<int> block) {
             return new StageLevels(layers, strategies, copy_buffer(intra, "intra_time"),
                                    copy_buffer(memory, "memory_mib"), copy_buffer(inter, "inter_time"),
                                    copy_buffer(transient, "transient_mib"), std::move(block));
           }),
           py::arg("layers"), py::arg("strategies"), py::arg("intra"), py::arg("memory"), py::arg("inter"),
           py::arg("transient"), py::arg("block") = std::vector<int>(),
           "inter: [L][S][S], or with block (one index per layer) the distinct [S][S] blocks")
      .def_property_readonly("levels",
                             [](const StageLevels& s) {
                               py::list out;
                               for (const auto& lv : s.levels())
                                 out.append(py::make_tuple(lv.tau, py::tuple(py::cast(lv.columns))));
                               return out;
                             },
                             "[(tau, kept candidates)] per level, in order of tau")
      .def_property_readonly("classes", [](const StageLevels& s) { return py::tuple(py::cast(s.classes())); },
                             "transition class of every candidate")
      .def("bound", &StageLevels::bound, py::arg("level"), py::arg("budget"),
           "lower bound on the time of the level's plans under the stage budget");

  m.def(
      "solve_stages",
      [](const py::list& stages, unsigned threads, bool cutoffs) {
        std::vector<std::pair<StageLevels*, double>> items;
        items.reserve(stages.size());
        for (const py::handle& h : stages) {
          const py::tuple t = h.cast<py::tuple>();
          if (t.size() != 2) throw py::value_error("each stage is (StageLevels, budget)");
          items.emplace_back(t[0].cast<StageLevels*>(), t[1].cast<double>());
        }
        LevelCounts counts;
        std::vector<StageSolution> out;
        {
          py::gil_scoped_release release;
          out = galva::dp::solve_stages(items, Options(), threads, counts, cutoffs);
        }
        py::list result;
        for (const StageSolution& s : out) result.append(to_python(s));
        return py::make_tuple(result, counts.solved, counts.reused);
      },
      py::arg("stages"), py::arg("threads") = 0, py::arg("cutoffs") = true,
      "Best plan of each (StageLevels, stage budget) over its levels, solved in rounds on C++ threads with the GIL "
      "released; cutoffs: tell each DP the best time its stages have. Returns (solutions or None, DPs solved, level "
      "solutions reused).");
}
