"""galva-comm: which ranks form each layer's groups, and the process groups themselves.

The layout algebra (:mod:`galva_comm.layout`) is pure Python and importable without torch;
process-group creation (:mod:`galva_comm.groups`) imports torch lazily.
"""

__version__ = "0.1.0"
