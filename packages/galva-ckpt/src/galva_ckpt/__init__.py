"""Layerwise, strategy-independent checkpoints for Galva; Hugging Face conversion (h2g / g2h).

This distribution is a placeholder with its metadata and dependencies; its capability arrives in a later release.
"""

__version__ = "0.1.0"
