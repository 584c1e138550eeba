"""galva-hp: build this rank's part of a model under a per-layer hybrid-parallel Strategy, and train it."""

__version__ = "0.1.0"
