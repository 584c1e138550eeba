"""Swin's table entry and its hooks: Swin Transformer for image classification, run as Hugging Face's own modules.

transformers gives Swin no tables, so Galva's entry says them in transformers' format: every block of every stage
(``encoder.layers.*.blocks``) is a Galva layer, its window attention and MLP split by heads and features under tp,
and its relative-position table (one column per head) split with the heads. The family's own code runs unchanged:
window partition, cyclic shift and its mask, padding, the relative-position bias, patch merging, the pooler.

What the table format cannot say is in the hooks below:

- :func:`layer_shapes`: the stages change the hidden size and the patch grid, and the base forward hands each block
  its grid (the embedding side returns it beside the hidden states), so each layer's type, heads, sizes and call
  are read from the config;
- the stage's patch merging (``downsample``) runs after its last block, on the same grid (``stage_end``);
- :func:`tail`: the base model's forward after the blocks (final norm, then the pooler over the tokens), which the
  classifier reads;
- :func:`sequence_parallel`: Megatron-SP around ``SwinLayer.forward`` (its windows need the whole grid).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from galva_hp.parallel.mappings import differentiable_gather_replicated, differentiable_split
from galva_hp.parallel.rng import group_stream
from galva_models.tables.hooks import LayerShape
from galva_models.tables.sharding import SEQ_DIM, TpRegion

__all__ = ["TABLE", "layer_shapes", "sequence_parallel", "tail"]


def _grid(config: Any) -> tuple[int, int]:
    """The patch grid of the configured image (the patch embedding pads the image to whole patches)."""
    image = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
    patch = config.patch_size if isinstance(config.patch_size, (list, tuple)) else (config.patch_size,) * 2
    return -(-image[0] // patch[0]), -(-image[1] // patch[1])


def layer_shapes(config: Any) -> list[LayerShape]:
    """One :class:`LayerShape` per block: its stage's type, heads, width and grid; a stage's last block outputs the
    merged grid (every stage but the last merges patches: ``(h + 1) // 2`` by ``(w + 1) // 2``)."""
    height, width = _grid(config)
    out: list[LayerShape] = []
    stages = len(config.depths)
    for stage, (depth, heads) in enumerate(zip(config.depths, config.num_heads, strict=True)):
        if depth < 1:
            raise ValueError(f"swin: depths {list(config.depths)}: stage {stage} has no block to run its patch merging")
        merged = (height + 1) // 2, (width + 1) // 2
        for block in range(depth):
            ends = block == depth - 1 and stage < stages - 1
            out.append(
                LayerShape(
                    layer_type=f"swin_stage{stage}",
                    heads=heads,
                    hidden=int(config.embed_dim * 2**stage),
                    tokens=height * width,
                    output_tokens=merged[0] * merged[1] if ends else None,
                    args=((height, width),),
                )
            )
        height, width = merged
    return out


def tail(modules: dict[str, nn.Module], hidden: Tensor) -> dict[str, Tensor]:
    """``SwinModel.forward`` after its encoder: the final norm, then the pooler averages over the tokens."""
    hidden = modules["layernorm"](hidden)
    return {"last_hidden_state": hidden, "pooler_output": modules["pooler"](hidden.transpose(1, 2)).flatten(1)}


def sequence_parallel(module: nn.Module, region: TpRegion) -> frozenset[str]:
    """Megatron-SP of one Swin block, in place around Hugging Face's own ``SwinLayer.forward`` (``module``: the Galva
    layer, holding ``layer`` and, where its stage ends, ``downsample``). Between layers the hidden states are
    sequence slices of the grid, in grid order. The windows need the whole grid, so the sequence is gathered where
    ``layernorm_before`` leaves it (before pad, shift and window partition; the gather that ends the attention's
    tp region), and the attention's row-parallel ``o_proj`` stays a partial sum through the window reverse, the
    unshift and the crop until ``drop_path`` (called once, on the attention branch, before the residual add; an
    identity without drop), whose output is reduce-scattered along the sequence. The MLP is the standard form
    (``mlp`` gathers, ``fc2`` reduce-scatters). Patch merging interleaves 2 x 2 cells of the whole grid: its input
    is gathered (every rank then holds the same grid) and its norm and reduction run on this rank's slice of the
    merged tokens, the next stage's own sequence. Returns the block whose region this hook handles.

    Random masks: the layer runs in this rank's stream (its sequence slice); the dropout on the attention output
    and the drop path, which meet the partial sums before the reduce-scatter, draw from the stream the group
    shares (every rank masks its part alike: the sum masked once), each from its own (``group_stream``)."""
    group = region.group
    layer: Any = module.layer  # Hugging Face's SwinLayer
    calls = [0]

    def first_dropout() -> bool:  # SwinLayer.forward's dropout: the attention output first, then the MLP's (a slice)
        calls[0] += 1
        return calls[0] == 1

    layer.register_forward_pre_hook(lambda m, args: calls.__setitem__(0, 0))
    _draw_alike(layer.dropout, 1, first_dropout)
    _draw_alike(layer.drop_path, 2, lambda: True)
    layer.layernorm_before.register_forward_hook(lambda m, args, out: region.enter(out))
    layer.drop_path.register_forward_hook(lambda m, args, out: region.leave(out))
    merging = getattr(module, TABLE["stage_end"], None)
    if merging is not None:
        merging.register_forward_pre_hook(
            lambda m, args: (differentiable_gather_replicated(args[0], SEQ_DIM, group), *args[1:])
        )
        merging.norm.register_forward_pre_hook(lambda m, args: (differentiable_split(args[0], SEQ_DIM, group),))
    return frozenset({"attention"})


def _draw_alike(module: nn.Module, salt: int, when: Callable[[], bool]) -> None:
    """``module`` (a dropout or drop path) draws from the tp group's shared stream on the calls ``when`` picks."""
    forward = module.forward

    def alike(hidden: Tensor) -> Tensor:
        if not when():
            return forward(hidden)
        with group_stream(hidden.device, salt):
            return forward(hidden)

    module.forward = alike


_BLOCK = "encoder.layers.*.blocks.*."

TABLE: dict[str, Any] = {
    "tp": {
        _BLOCK + "attention.q_proj": "colwise",
        _BLOCK + "attention.k_proj": "colwise",
        _BLOCK + "attention.v_proj": "colwise",
        _BLOCK + "attention.relative_position_bias": "per_head",
        _BLOCK + "attention.o_proj": "rowwise",
        _BLOCK + "mlp.fc1": "colwise",
        _BLOCK + "mlp.fc2": "rowwise",
    },
    "pp": {"embeddings": None, "encoder.layers.*.blocks": None, "layernorm": None, "pooler": None},
    "layers": "encoder.layers.*.blocks",
    "stage_end": "downsample",
    "task": "image_classification",
    "inputs": "pixel_values",
    "token_table": None,
    "head": {"classifier": "classifier"},
    "layer_shapes": layer_shapes,
    "tail": tail,
    "sequence_parallel": sequence_parallel,
    # galva-train's size flags: the sizes and heads are per stage, the depths four numbers (edit a --model-config)
    "facts": {"per_stage_sizes": True, "head_dim_from_hidden": False, "set_num_layers": None, "ffn_size_field": None},
}
"""Swin's entry in :data:`~galva_models.tables.plans.GALVA_TABLES`."""
