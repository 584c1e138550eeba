"""Hardware and model profiling for Galva: collective bandwidths, overlap, per-layer time and memory.

This distribution is a placeholder with its metadata and dependencies; its capability arrives in a later release.
"""

__version__ = "0.1.0"
