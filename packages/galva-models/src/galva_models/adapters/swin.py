"""Swin Transformer for image classification: four stages as four layer types.

Galva modules:

- embedding ``SwinEmbedding``: ``embeddings`` = ``SwinEmbeddings`` ``pixels -> [b, (H/p)*(W/p), C]``
- layers ``"swin_stage0"`` .. ``"swin_stage3"`` ``SwinBlock``: ``block`` = one ``SwinLayer`` (window attention with
  its own shift); the last block of a stage also holds the stage's ``downsample`` (patch merging), so a stage's
  output boundary already has the next stage's shape ``[b, seq/4, 2C]``. Each block knows its grid size.
- head ``ClassifierHead``: ``norm`` (final LayerNorm), mean over tokens, ``classifier``
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from galva_hp.model import LayeredModel, ParallelContext
from galva_models.adapters.base import (
    FamilyAdapter,
    LayerSpec,
    SingleRankParallelizer,
    Task,
    check_full_coverage,
    first_output,
)
from galva_models.adapters.parallel import mlp_form
from galva_models.adapters.vit import ClassifierHead


class SwinEmbedding(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, pixel_values: Tensor) -> Tensor:
        return first_output(self.embeddings(pixel_values))


class SwinBlock(nn.Module):
    """One Swin block on a fixed ``grid`` (height, width) of patches, then the stage's patch merging if any."""

    def __init__(self, block: nn.Module, grid: tuple[int, int], downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.grid = grid
        self.downsample = downsample

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = first_output(self.block(hidden, self.grid))
        if self.downsample is not None:
            hidden = self.downsample(hidden, self.grid)
        return hidden


def _grids(config: Any) -> list[tuple[int, int]]:
    side = config.image_size // config.patch_size
    out = []
    for _ in config.depths:
        out.append((side, side))
        side = (side + 1) // 2
    return out


def _partitioned(tensor: Tensor, dim: int) -> nn.Parameter:
    """Mark a tensor-parallel shard the way megatron does, so galva-hp counts it as a shard, never as a replica
    (shards that happen to be equal, e.g. zero-initialised biases, would otherwise look replicated)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
    set_tensor_model_parallel_attributes(param, True, dim, 1)
    return param


class _EnterTP(nn.Module):
    """Runs the (head-sharded) Hugging Face window attention on input entering the tp region."""

    def __init__(self, attention: nn.Module, group: ProcessGroup | None) -> None:
        super().__init__()
        self.attention = attention
        self.group = group

    def forward(self, hidden: Tensor, mask: Tensor | None = None, **kwargs: Any) -> Any:
        from galva_hp.parallel.mappings import copy_to_group

        return self.attention(copy_to_group(hidden, self.group), mask, **kwargs)


class _RowParallelOut(nn.Module):
    """Output projection over this rank's heads: partial product, all-reduce over tp, then the (full) bias."""

    def __init__(self, linear: nn.Linear, group: ProcessGroup | None) -> None:
        super().__init__()
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import shard

        self.group = group
        self.weight = _partitioned(shard(linear.weight.detach(), 1, group_rank(group), group_size(group)).clone(), 1)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        from galva_hp.parallel.mappings import reduce_from_group

        return reduce_from_group(nn.functional.linear(x, self.weight), self.group) + self.bias


class SwinParallelizer(SingleRankParallelizer):
    """Tensor-parallel Swin blocks: the window attention keeps this rank's heads (q/k/v rows, the relative-position
    table's columns, the output projection's input columns) and runs Hugging Face's own window code; the MLP is
    megatron column/row-parallel. No Megatron-SP or Ulysses (windows need the whole patch grid); embedding and
    head at degree 1."""

    def __init__(self) -> None:
        super().__init__("swin")

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        from galva_hp.parallel.tensor_parallel import shard

        self._check_tp_only(ctx)
        out = copy.deepcopy(module)
        block, tp, rank = out.block, ctx.tp_size, ctx.tp_rank
        attn = block.attention
        if attn.num_attention_heads % tp:
            raise ValueError(f"swin: tp={tp} does not divide the {attn.num_attention_heads} heads of {layer_type}")
        for name in ("q_proj", "k_proj", "v_proj"):
            full = getattr(attn, name)
            local = nn.Linear(full.in_features, full.out_features // tp, bias=full.bias is not None)
            with torch.no_grad():
                local.weight.copy_(shard(full.weight, 0, rank, tp))
                if full.bias is not None:
                    local.bias.copy_(shard(full.bias, 0, rank, tp))
            for param in local.parameters():
                _partitioned(param, 0)
            setattr(attn, name, local)
        attn.num_attention_heads //= tp
        table = attn.relative_position_bias.relative_position_bias_table
        attn.relative_position_bias.relative_position_bias_table = _partitioned(
            shard(table.detach(), 1, rank, tp).clone(), 1
        )
        attn.o_proj = _RowParallelOut(attn.o_proj, ctx.tp_group)
        block.attention = _EnterTP(attn, ctx.tp_group)
        block.mlp = mlp_form(block.mlp.fc1, block.mlp.fc2, block.mlp.activation_fn, ctx)
        return out

    def _check_tp_only(self, ctx: ParallelContext) -> None:
        if ctx.sp_size > 1 or ctx.megatron_sp:
            raise NotImplementedError("swin: only plain tensor parallelism (no Megatron-SP or Ulysses)")


def build_model(config: Any, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import SwinForImageClassification

    return SwinForImageClassification._from_config(config, attn_implementation=attn_implementation)


def decompose(model: Any) -> LayeredModel:
    """``SwinForImageClassification`` -> LayeredModel sharing its modules."""
    swin = model.swin
    layers: list[nn.Module] = []
    types: list[str] = []
    for index, (stage, grid) in enumerate(zip(swin.encoder.layers, _grids(model.config))):
        blocks = list(stage.blocks)
        for j, block in enumerate(blocks):
            layers.append(SwinBlock(block, grid, stage.downsample if j == len(blocks) - 1 else None))
            types.append(f"swin_stage{index}")
    layered = LayeredModel(
        embedding=SwinEmbedding(swin.embeddings),
        layers=layers,
        head=ClassifierHead(swin.layernorm, model.classifier, pool="mean"),
        layer_types=types,
        parallelizer=SwinParallelizer(),
        name="swin",
    )
    check_full_coverage(model, layered)
    return layered


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    """``seq_length`` is ignored: each stage's sequence is its patch grid. Specs describe each layer's input."""
    out: list[LayerSpec] = []
    for index, (depth, heads, grid) in enumerate(zip(config.depths, config.num_heads, _grids(config))):
        dim = config.embed_dim * 2**index
        out += [LayerSpec(f"swin_stage{index}", heads, heads, grid[0] * grid[1], dim)] * depth
    return out


ADAPTER = FamilyAdapter(
    name="swin",
    model_types=("swin",),
    task=Task.IMAGE_CLASSIFICATION,
    build_model=build_model,
    decompose=decompose,
    layer_specs=layer_specs,
    set_num_layers=None,  # four stage depths: edit them in a --model-config
    parallel_forms=frozenset({"tp"}),
    notes=("a stage's last block outputs the next stage's shape (patch merging is part of it)",),
)
