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
  classifier reads.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from galva_models.tables.hooks import LayerShape

__all__ = ["TABLE", "layer_shapes", "tail"]


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
    # galva-train's size flags: the sizes and heads are per stage, the depths four numbers (edit a --model-config)
    "adapter": {"per_stage_sizes": True, "head_dim_from_hidden": False, "set_num_layers": None, "ffn_size_field": None},
}
"""Swin's entry in :data:`~galva_models.tables.plans.GALVA_TABLES`."""
