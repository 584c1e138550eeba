"""Plan validation: reject a strategy that cannot run on a model, before any process group exists.

:func:`check_plan` raises one :class:`~galva_schema.SchemaError` whose message names every offending field and
layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from galva_hp.model import LayeredModel
from galva_schema import Precision, SchemaError, Strategy
from galva_schema.errors import group_problems

__all__ = ["check_plan"]


def check_plan(
    model: LayeredModel, strategy: Strategy, world_size: int | None = None, seq_len: int | None = None
) -> None:
    """Raise :class:`~galva_schema.SchemaError` (one line naming field and layer) if ``strategy`` cannot run."""
    problems: list[str] = []
    if world_size is not None and strategy.world_size != world_size:
        problems.append(
            f"world_size: the strategy has {strategy.world_size} ranks but the process group has {world_size}"
        )
    if strategy.num_layers != model.num_layers:
        problems.append(
            f"layers: the strategy has {strategy.num_layers} layers but {model.name} has {model.num_layers}"
        )
    if strategy.mixed_precision is Precision.FP16:
        problems.append("mixed_precision: fp16 needs loss scaling, which galva-hp does not do; use bf16 or fp32")
    if strategy.num_layers == model.num_layers:
        plan_problems = getattr(model.parallelizer, "plan_problems", None)
        problems.extend(plan_problems(strategy, seq_len) if plan_problems else _head_problems(model, strategy))
    if seq_len is not None:
        seq_issues: list[tuple[str, int | None, str, str]] = []
        for index, layer in enumerate(strategy.layers):
            parts = layer.tp if (layer.ulysses or (strategy.megatron_sp and layer.tp > 1)) else 1
            if seq_len % parts:
                what = "Ulysses" if layer.ulysses else "Megatron-SP"
                seq_issues.append(
                    ("layers", index, ".tp", f"sequence length {seq_len} is not divisible by {what} degree {parts}")
                )
        vocab = strategy.vocab
        parts = vocab.tp if (vocab.sp or (strategy.megatron_sp and vocab.tp > 1)) else 1
        if seq_len % parts:
            seq_issues.append(
                ("vocab", None, ".tp", f"sequence length {seq_len} is not divisible by sequence degree {parts}")
            )
        problems.extend(group_problems(seq_issues))
    if problems:
        raise SchemaError("; ".join(dict.fromkeys(problems)), source="strategy")


_HEAD_ATTRS = ("heads", "num_heads", "num_attention_heads")
_KV_HEAD_ATTRS = ("kv_heads", "num_kv_heads", "num_key_value_heads")


def _head_problems(model: LayeredModel, strategy: Strategy) -> list[str]:
    """tp / Ulysses degrees that do not divide a layer's attention heads.

    A parallelizer may answer this itself with ``plan_problems(strategy, seq_len) -> list[str]``; otherwise the
    layer's modules are searched for the usual head-count attributes (``heads``, ``num_heads``,
    ``num_attention_heads`` and their K/V counterparts), which works on meta modules too.
    """
    issues: list[tuple[str, int | None, str, str]] = []
    for index, (layer, module) in enumerate(zip(strategy.layers, model.layers)):
        if layer.tp == 1:
            continue
        heads, kv_heads = _find_int(module, _HEAD_ATTRS), _find_int(module, _KV_HEAD_ATTRS)
        kind = "Ulysses degree" if layer.ulysses else "tp"
        if heads is not None and heads % layer.tp:
            issues.append(("layers", index, ".tp", f"{kind} {layer.tp} does not divide the {heads} heads"))
        elif kv_heads is not None and not layer.ulysses and kv_heads % layer.tp and layer.tp % kv_heads:
            issues.append(("layers", index, ".tp", f"tp {layer.tp} and the {kv_heads} key/value heads do not divide"))
    return group_problems(issues)


def _find_int(module: nn.Module, names: Sequence[str]) -> int | None:
    for sub in module.modules():
        for name in names:
            value = getattr(sub, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        config = getattr(sub, "config", None)
        for name in names:
            value = getattr(config, name, None) if config is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
