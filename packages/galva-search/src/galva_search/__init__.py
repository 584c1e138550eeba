"""galva-search: choose the fastest per-layer hybrid-parallel Strategy under a memory budget. Never imports torch."""

__version__ = "0.1.0"
