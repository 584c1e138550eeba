"""Swin Transformer for image classification: four stages as four layer types.

Galva modules:

- embedding ``HFEmbeddings``: ``embeddings`` = ``SwinEmbeddings`` ``pixels -> [b, (H/p)*(W/p), C]``
- layers ``"swin_stage0"`` .. ``"swin_stage3"`` ``SwinBlock``: ``block`` = one ``SwinLayer`` (window attention with
  its own shift); the last block of a stage also holds the stage's ``downsample`` (patch merging), so a stage's
  output boundary already has the next stage's shape ``[b, seq/4, 2C]``. Each block knows its grid size.
- head ``ClassifierHead``: ``norm`` (final LayerNorm), mean over tokens, ``classifier``

Parallel layer forms (:class:`SwinParallelBlock`): Megatron tp, optionally Megatron-SP (tokens of the flattened
grid sharded at the boundaries), and Ulysses. Windows need the whole grid, so the attention gathers it (all-gather
under Megatron-SP, all-to-all of q/k/v under Ulysses), and a stage's patch merging gathers the grid, interleaves and
re-shards the merged tokens. A sequence-sharding degree must divide every grid it meets (:func:`constraints`).
"""

from __future__ import annotations

import contextlib
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
    image_vocab_unsupported,
    tie_and_check,
)
from galva_models.adapters.modules import ClassifierHead, HFEmbeddings, first_output
from galva_models.adapters.parallel import ImageVocabForms, dropout_form, linear_from, tp_group
from galva_schema import LayerTypeConstraints, ModelConstraints


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


class _Windows:
    """A Swin layer's window geometry on a fixed grid: Hugging Face's own pad / shift / mask / partition code."""

    def __init__(self, layer: Any, grid: tuple[int, int]) -> None:
        from transformers.models.swin import modeling_swin

        self._hf = modeling_swin
        self._layer_cls: Any = type(layer)
        self.window_size, self.shift_size = layer.window_size, layer.shift_size
        self._layer_cls.set_shift_and_window_size(self, grid)  # what SwinLayer.forward does on every call
        self.grid = grid

    def split(self, x: Tensor) -> Tensor:
        """``[b, H*W, c]`` (the whole grid) -> windows ``[b * n_windows, ws*ws, c]`` (padded, shifted)."""
        (height, width), ws = self.grid, self.window_size
        x, _ = self._layer_cls.maybe_pad(self, x.view(x.shape[0], height, width, x.shape[-1]), height, width)
        windows = self._hf.window_partition(self._layer_cls.cyclic_shift(self, x), ws)
        return windows.view(-1, ws * ws, x.shape[-1])

    def merge(self, windows: Tensor, batch: int) -> Tensor:
        """Inverse of :meth:`split`: windows ``[b * n_windows, ws*ws, c]`` -> ``[b, H*W, c]``."""
        (height, width), ws = self.grid, self.window_size
        padded_h, padded_w = -(-height // ws) * ws, -(-width // ws) * ws
        x = self._hf.window_reverse(windows.view(-1, ws, ws, windows.shape[-1]), ws, padded_h, padded_w)
        x = self._layer_cls.cyclic_shift(self, x, reverse=True)[:, :height, :width, :]
        return x.reshape(batch, height * width, windows.shape[-1])

    def mask(self, like: Tensor) -> Tensor | None:
        """Shifted-window mask ``[n_windows, ws*ws, ws*ws]`` (None without a shift)."""
        (height, width), ws = self.grid, self.window_size
        padded_h, padded_w = -(-height // ws) * ws, -(-width // ws) * ws
        return self._layer_cls.get_attn_mask(self, padded_h, padded_w, dtype=like.dtype, device=like.device)


class _GatherReplicated(torch.autograd.Function):
    """All-gather along ``dim`` for a *replicated* consumer: every rank then computes the same thing, so the backward
    keeps this rank's chunk of the (identical) full gradient instead of summing it over the group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        from galva_hp.parallel.mappings import all_gather_along_dim

        ctx.dim, ctx.group = dim, group
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        from galva_hp.parallel.mappings import chunk_along_dim

        return chunk_along_dim(grad, ctx.dim, ctx.group), None, None


class SwinWindowAttention(nn.Module):
    """Window attention over the whole patch grid, from a boundary-layout input to a boundary-layout output.

    - tp (``ulysses=False``): this rank's heads (q/k/v rows, relative-position table columns, ``o_proj`` input
      columns); the input enters the tp region (copy, or all-gather along the sequence under Megatron-SP) and the
      row-parallel ``o_proj`` exits it (all-reduce, or reduce-scatter along the sequence), then its full bias.
    - Ulysses: replicated weights; q/k/v projected on the local tokens, one all-to-all each scatters the heads and
      gathers the sequence (windows need the whole grid), attention on this rank's heads with its columns of the
      relative-position bias, one all-to-all back, ``o_proj`` on the local tokens. q/k/v biases are added after the
      exchange so that padded grid cells get exactly the bias, as in Hugging Face (which pads before projecting).
    """

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear

    def __init__(
        self, attention: Any, windows: _Windows, group: ProcessGroup, *, ulysses: bool, sequence_parallel: bool
    ) -> None:
        super().__init__()
        from galva_hp.parallel.mappings import group_rank, group_size
        from galva_hp.parallel.tensor_parallel import shard

        n, rank = group_size(group), group_rank(group)
        heads = attention.num_attention_heads
        if heads % n:
            kind = "Ulysses degree" if ulysses else "tp"
            raise ValueError(f"swin: {kind} {n} does not divide the {heads} heads of a window attention")
        self.group, self.ulysses, self.sequence_parallel, self.windows = group, ulysses, sequence_parallel, windows
        self.heads, self.local_heads, self.head_dim = heads, heads // n, attention.head_dim
        self.rank, self.scaling = rank, attention.scaling
        self.dropout_p = attention.attention_dropout
        self.relative_position_bias: Any = copy.deepcopy(attention.relative_position_bias)
        if ulysses:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self, name, copy.deepcopy(getattr(attention, name)))
            return
        for name in ("q_proj", "k_proj", "v_proj"):
            full = getattr(attention, name)
            bias = None if full.bias is None else shard(full.bias, 0, rank, n)
            local = linear_from(shard(full.weight, 0, rank, n).detach(), None if bias is None else bias.detach())
            for param in local.parameters():
                _partitioned(param, 0)
            setattr(self, name, local)
        table = attention.relative_position_bias.relative_position_bias_table
        self.relative_position_bias.relative_position_bias_table = _partitioned(
            shard(table.detach(), 1, rank, n).clone(), 1
        )
        self.o_proj = nn.Linear(attention.o_proj.in_features // n, attention.o_proj.out_features)
        with torch.no_grad():
            self.o_proj.weight.copy_(shard(attention.o_proj.weight, 1, rank, n))
            self.o_proj.bias.copy_(attention.o_proj.bias)
        self.o_proj.to(attention.o_proj.weight.device, attention.o_proj.weight.dtype)
        _partitioned(self.o_proj.weight, 1)

    def gather_full(self, grads: bool = False) -> dict[str, Tensor]:
        """The single-process ``SwinAttention`` state (tp shards assembled over the group; Ulysses: as held)."""
        from galva_hp.parallel.mappings import all_gather_along_dim
        from galva_hp.parallel.tensor_parallel import param_or_grad

        full = {name: param_or_grad(p, grads) for name, p in self.named_parameters()}
        if self.ulysses:
            return full
        split_dims = {"o_proj.weight": 1, "relative_position_bias.relative_position_bias_table": 1}
        for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            split_dims[name] = 0
        return {
            name: all_gather_along_dim(t, split_dims[name], self.group) if name in split_dims else t
            for name, t in full.items()
        }

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Tensor | None) -> Tensor:
        """Softmax attention per window: ``[windows, ws*ws, heads*d]`` each; bias ``[1, heads, n, n]``."""
        windows, n, _ = q.shape
        q, k, v = (t.view(windows, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if mask is not None:  # [n_windows, n, n] per image, images outermost (window_partition's order)
            bias = bias + mask.unsqueeze(1).repeat(windows // mask.shape[0], 1, 1, 1)
        from galva_hp.parallel.rng import rank_stream

        p = self.dropout_p if self.training else 0.0
        with rank_stream(self.group, q.device) if p else contextlib.nullcontext():  # this rank's heads
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=self.scaling)
        return out.transpose(1, 2).reshape(windows, n, -1)

    def forward(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.mappings import differentiable_copy_to_group
        from galva_hp.parallel.tensor_parallel import enter_tp_region, exit_tp_region

        if self.ulysses:
            return self._ulysses(hidden)
        batch = hidden.shape[0]
        windows = self.windows.split(enter_tp_region(hidden, self.group, self.sequence_parallel))
        q, k, v = self.q_proj(windows), self.k_proj(windows), self.v_proj(windows)
        out = self._attend(q, k, v, self.relative_position_bias(), self.windows.mask(hidden))
        out = nn.functional.linear(self.windows.merge(out, batch), self.o_proj.weight)
        out = exit_tp_region(out, self.group, self.sequence_parallel)
        # under Megatron-SP the bias meets a sequence shard: its gradient is summed over the tp group
        return out + (
            differentiable_copy_to_group(self.o_proj.bias, self.group) if self.sequence_parallel else self.o_proj.bias
        )

    def _ulysses(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.mappings import differentiable_all_to_all

        batch, local = hidden.shape[:2]
        width = self.local_heads * self.head_dim
        heads = slice(self.rank * width, (self.rank + 1) * width)
        qkv = []
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            t = nn.functional.linear(hidden, proj.weight).view(batch, local, self.heads, self.head_dim)
            t = differentiable_all_to_all(t, 2, 1, self.group).reshape(batch, -1, width)  # [b, H*W, local heads * d]
            t = self.windows.split(t)
            qkv.append(t if proj.bias is None else t + proj.bias[heads])
        bias = self.relative_position_bias()[:, self.rank * self.local_heads : (self.rank + 1) * self.local_heads]
        out = self.windows.merge(self._attend(qkv[0], qkv[1], qkv[2], bias, self.windows.mask(hidden)), batch)
        out = differentiable_all_to_all(out.view(batch, -1, self.local_heads, self.head_dim), 1, 2, self.group)
        return self.o_proj(out.reshape(batch, local, self.heads * self.head_dim))


class SwinPatchMergingShard(nn.Module):
    """Patch merging on a sequence-sharded boundary: gather the grid (the 2x2 interleave needs it), interleave, keep
    this rank's share of the merged tokens, then the norm and reduction on that share (their gradients summed over
    ``group`` when ``sum_grads``: Megatron-SP; Ulysses leaves that to the runtime's sharding-group reduction)."""

    def __init__(self, merging: Any, grid: tuple[int, int], group: ProcessGroup, sum_grads: bool) -> None:
        super().__init__()
        from galva_hp.parallel.tensor_parallel import mark_sequence_parallel, sequence_parallel_norm

        self.norm = sequence_parallel_norm(merging.norm, group) if sum_grads else copy.deepcopy(merging.norm)
        self.reduction = copy.deepcopy(merging.reduction)
        if sum_grads:
            mark_sequence_parallel(self.reduction.weight)
        self._pad = type(merging).maybe_pad
        self.grid, self.group, self.sum_grads = grid, group, sum_grads

    def forward(self, hidden: Tensor) -> Tensor:
        from galva_hp.parallel.mappings import differentiable_copy_to_group, differentiable_split

        full = _GatherReplicated.apply(hidden, 1, self.group)
        (height, width), (batch, _, channels) = self.grid, full.shape
        grid = self._pad(self, full.view(batch, height, width, channels), height, width)
        merged = torch.cat([grid[:, row::2, col::2, :] for col in range(2) for row in range(2)], dim=-1)
        merged = differentiable_split(merged.reshape(batch, -1, 4 * channels), 1, self.group)
        weight = (
            differentiable_copy_to_group(self.reduction.weight, self.group) if self.sum_grads else self.reduction.weight
        )
        return nn.functional.linear(self.norm(merged), weight, self.reduction.bias)


class _SwinLayerParts(nn.Module):
    """The parts of a parallel ``SwinLayer`` under the single-process names (``layernorm_before``, ``attention``,
    ``layernorm_after``, ``mlp.fc1``/``fc2``), so the gathered state is the single-process layer's."""

    def __init__(self, norm1: nn.Module, attention: nn.Module, norm2: nn.Module, mlp: nn.Module, layer: Any) -> None:
        super().__init__()
        self.layernorm_before, self.attention, self.layernorm_after, self.mlp = norm1, attention, norm2, mlp
        self.dropout, self.drop_path = copy.deepcopy(layer.dropout), copy.deepcopy(layer.drop_path)


class SwinParallelBlock(nn.Module):
    """A ``SwinBlock`` in a tp (optionally Megatron-SP) or Ulysses layout: norms and MLP on the boundary layout,
    window attention over the whole grid (see :class:`SwinWindowAttention`), then the stage's patch merging."""

    def __init__(self, module: Any, ctx: ParallelContext) -> None:
        super().__init__()
        from galva_hp.parallel.tensor_parallel import TensorParallelMLP, sequence_parallel_norm

        layer, ulysses = module.block, ctx.sp_size > 1
        group = ctx.sp_group if ulysses else tp_group(ctx)
        assert group is not None
        windows = _Windows(layer, module.grid)
        attention = SwinWindowAttention(
            layer.attention, windows, group, ulysses=ulysses, sequence_parallel=ctx.megatron_sp
        )
        mlp: nn.Module
        if ulysses:
            mlp = copy.deepcopy(layer.mlp)
        else:
            fc1, fc2 = layer.mlp.fc1, layer.mlp.fc2
            mlp = TensorParallelMLP(
                [fc1.weight], [fc1.bias], fc2.weight, fc2.bias, copy.deepcopy(layer.mlp.activation_fn),
                group=group, sequence_parallel=ctx.megatron_sp, names=(["fc1"], "fc2"),
            )  # fmt: skip
        sp_norms = ctx.sequence_parallel_tp
        norms = [sequence_parallel_norm(n, group) if sp_norms else copy.deepcopy(n)
                 for n in (layer.layernorm_before, layer.layernorm_after)]  # fmt: skip
        self.block: _SwinLayerParts = _SwinLayerParts(norms[0], attention, norms[1], mlp, layer)
        self.block.dropout = dropout_form(layer.dropout, ctx)  # a sequence slice draws its own mask
        self.grid = module.grid
        self.downsample: nn.Module | None = None
        if module.downsample is not None:
            if ctx.seq_sharded:
                self.downsample = SwinPatchMergingShard(module.downsample, module.grid, group, sum_grads=sp_norms)
            else:
                self.downsample = copy.deepcopy(module.downsample)

    def forward(self, hidden: Tensor) -> Tensor:
        parts = self.block
        attention = parts.attention(parts.layernorm_before(hidden))
        hidden = hidden + parts.drop_path(parts.dropout(attention))
        hidden = hidden + parts.dropout(parts.mlp(parts.layernorm_after(hidden)))
        if self.downsample is None:
            return hidden
        if isinstance(self.downsample, SwinPatchMergingShard):
            return self.downsample(hidden)
        return self.downsample(hidden, self.grid)


class SwinParallelizer(ImageVocabForms, SingleRankParallelizer):
    """Swin blocks in every layer form galva-hp has: Megatron tp (optionally Megatron-SP) and Ulysses, both with the
    window attention over the whole patch grid (:class:`SwinParallelBlock`). Patch embedding and classifier:
    :class:`ImageVocabForms` (vocab tp, sequence-split embedding under Megatron-SP)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__("swin", config)

    def layer(self, module: Any, layer_type: str, ctx: ParallelContext) -> nn.Module:
        if ctx.tp_size == 1 and ctx.sp_size == 1:
            return module
        return SwinParallelBlock(module, ctx)


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
        embedding=HFEmbeddings(swin.embeddings),
        layers=layers,
        head=ClassifierHead(swin.layernorm, model.classifier, pool="mean"),
        layer_types=types,
        parallelizer=SwinParallelizer(model.config),
        name="swin",
        constraints=constraints(model.config),
    )
    return tie_and_check(model, layered)


def constraints(config: Any, seq_length: int | None = None, decoder_seq_length: int | None = None) -> ModelConstraints:
    """One layer type per stage, each on its own patch grid; a stage's last block also outputs the merged grid
    (the next stage's), which a sequence split must divide too. Embedding and head: vocab tp, not vocab sp."""
    grids = [g[0] * g[1] for g in _grids(config)]
    types = []
    for index, (depth, heads) in enumerate(zip(config.depths, config.num_heads)):
        if depth == 0:
            continue
        merged = grids[index + 1] if index + 1 < len(grids) else None  # every stage but the last merges patches
        types.append(
            LayerTypeConstraints(
                name=f"swin_stage{index}",
                num_layers=depth,
                num_heads=heads,
                seq_length=grids[index],
                output_seq_length=merged,
            )
        )
    return ModelConstraints(
        model_name="swin", layer_types=tuple(types), vocab_unsupported=image_vocab_unsupported("swin")
    )


def layer_specs(config: Any, seq_length: int) -> list[LayerSpec]:
    """``seq_length`` is ignored: each stage's sequence is its patch grid. Specs describe each layer's input."""
    out: list[LayerSpec] = []
    for index, (depth, grid) in enumerate(zip(config.depths, _grids(config))):
        out += [LayerSpec(f"swin_stage{index}", grid[0] * grid[1], config.embed_dim * 2**index)] * depth
    return out


ADAPTER = FamilyAdapter(
    name="swin", model_types=("swin",), task=Task.IMAGE_CLASSIFICATION,
    build_model=build_model, decompose=decompose, constraints=constraints, layer_specs=layer_specs,
    set_num_layers=None,  # four stage depths: edit them in a --model-config
    per_stage_sizes=True,  # embed_dim doubles and num_heads is a list, stage by stage
    head_dim_from_hidden=False,
)  # fmt: skip
