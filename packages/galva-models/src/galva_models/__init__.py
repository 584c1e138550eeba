"""Hugging Face model adapters, datasets and the galva-train command.

This distribution is a placeholder with its metadata and dependencies; its capability arrives in a later release.
"""

__version__ = "0.1.0"
