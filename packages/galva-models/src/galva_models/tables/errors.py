"""The one error of the table path a user sees as one line: a model Galva cannot take as it is."""

from __future__ import annotations

__all__ = ["UnsupportedModel"]


class UnsupportedModel(ValueError):
    """The model's own structure is outside what Galva runs (its tables name a module it does not have, a parameter
    no Galva module holds, a layer its forward runs more than once); the message names the model and the part."""
