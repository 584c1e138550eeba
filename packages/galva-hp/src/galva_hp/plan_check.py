"""Plan validation: reject a strategy that cannot run on a model, before any process group exists.

The decision is galva-schema's :func:`~galva_schema.plan_problems`, made from the constraints the model declares
(:attr:`galva_hp.model.LayeredModel.constraints`); galva-train's command line asks the same function, so both report
the same problems in the same words.
"""

from __future__ import annotations

from galva_hp.model import LayeredModel
from galva_schema import SchemaError, Strategy, plan_problems

__all__ = ["check_plan"]


def check_plan(
    model: LayeredModel, strategy: Strategy, world_size: int | None = None, seq_len: int | None = None
) -> None:
    """Raise :class:`~galva_schema.SchemaError` naming every offending field and layer if ``strategy`` cannot run
    on ``model`` with ``world_size`` ranks at sequence length ``seq_len`` (each checked when given)."""
    problems = plan_problems(strategy, model.constraints, world_size=world_size, seq_len=seq_len)
    if problems:
        raise SchemaError("; ".join(problems), source="strategy")
