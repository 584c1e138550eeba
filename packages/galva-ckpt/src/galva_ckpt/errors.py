"""The one error galva-ckpt raises for a bad input: its message is one line naming the file (and tensor)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(Exception):
    """A checkpoint (or Hugging Face directory) that cannot be used as asked; ``str()`` is one line for the user."""
