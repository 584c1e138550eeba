"""The label convention shared by every loss and by the runtime's token count."""

from __future__ import annotations

__all__ = ["IGNORE_INDEX"]

IGNORE_INDEX = -100
"""A label equal to this value is not a token: it counts neither in the loss sum nor in the token count (the value
torch's ``cross_entropy`` and Hugging Face use)."""
