"""Learning-rate schedules of ``--lr-decay-style``: linear warm-up, then cosine, linear or constant.

galva-hp's optimizer owns the warm-up-then-cosine schedule (:func:`galva_hp.optim.lr_factor`); the cosine style is
that function itself, so a cosine run here and galva-hp's own reference optimizer agree exactly. Linear and
constant use the same warm-up (``(step + 1) / warmup_steps``) and the same end point (``min_lr_ratio`` at
``total_steps``), as Megatron-LM's ``--lr-decay-style`` does.
"""

from __future__ import annotations

from collections.abc import Callable

DECAY_STYLES = ("cosine", "linear", "constant")


def lr_factor(style: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at a 0-based step (for ``torch.optim.lr_scheduler.LambdaLR``)."""
    if style not in DECAY_STYLES:
        raise ValueError(f"lr decay style {style!r} is not one of {', '.join(DECAY_STYLES)}")
    if style == "cosine":
        from galva_hp.optim import OptimConfig
        from galva_hp.optim import lr_factor as cosine_factor

        config = OptimConfig(warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
        return cosine_factor(config)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)

    return factor
