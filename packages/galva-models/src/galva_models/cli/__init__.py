"""Command-line entry points: ``galva-data`` and ``galva-train``."""
