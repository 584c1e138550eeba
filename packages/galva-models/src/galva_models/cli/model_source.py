"""Which model galva-train trains: a preset, a config directory or a checkpoint, then the size overrides.

Every family-specific fact (which field ``--ffn-hidden-size`` sets, whether sizes differ per stage, ...) comes
from the family's :class:`~galva_models.tables.family.FamilyAdapter`; nothing here names a family.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from galva_models.cli.errors import ConfigError
from galva_models.presets import PRESETS, UnknownPresetError, preset_config
from galva_models.tables.family import FamilyAdapter, LayerSpec, Task

SHAPE_OVERRIDES = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
    "max_position_embeddings",
)  # fmt: skip
"""Flags that change parameter shapes (a checkpoint's weights would no longer fit)."""

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
"""What a Hugging Face model directory holds its weights in."""


def family_name(adapter: FamilyAdapter, config: Any) -> str:
    """The family a message names: the adapter's, or the ``model_type`` of a family run from its tables."""
    return adapter.name if adapter.model_types else str(getattr(config, "model_type", adapter.name))


def model_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The transformers config named by ``--model`` / ``--model-config`` / ``--hf-checkpoint``, and a run name."""
    if args.preset is None and args.model_config is None and args.hf_checkpoint is None:
        if getattr(args, "load", None) is not None:
            return _checkpoint_config(args)
        raise ConfigError(
            "give --model PRESET, --model-config DIR, --hf-checkpoint DIR or --load DIR "
            f"(presets: {', '.join(PRESETS)})"
        )
    if args.hf_checkpoint is not None:
        given = [name for name in SHAPE_OVERRIDES if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag}: the weights come from --hf-checkpoint {args.hf_checkpoint}; drop the override")
    if args.preset is not None:
        try:
            return preset_config(args.preset), args.preset
        except UnknownPresetError as err:
            raise ConfigError(str(err)) from None
    directory = Path(args.model_config or args.hf_checkpoint)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory}: no config.json (expected a Hugging Face model or config directory)")
    if args.hf_checkpoint is not None and not any(next(directory.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(
            f"--hf-checkpoint {directory}: a config.json but no weights (*.safetensors or pytorch_model*.bin); "
            "for a fresh model use --model-config"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True), directory.name
    except (OSError, ValueError) as err:
        raise ConfigError(f"{directory}: cannot read config.json: {str(err).splitlines()[0]}") from None


def _checkpoint_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The config a ``--load`` checkpoint holds (a Galva manifest's, or a Hugging Face config.json)."""
    from galva_ckpt.errors import CheckpointError
    from galva_ckpt.sources import open_weights
    from galva_models.checkpoint_names import config_from_dict

    given = [name for name in SHAPE_OVERRIDES if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag}: the weights come from --load {args.load}; drop the override")
    try:
        source = open_weights(args.load, warn=False)
        return config_from_dict(source.config), source.directory.name
    except CheckpointError as err:
        raise ConfigError(f"--load: {err}") from None
    except ValueError as err:
        raise ConfigError(f"--load {args.load}: {str(err).splitlines()[0]}") from None


def apply_overrides(config: Any, adapter: FamilyAdapter, args: argparse.Namespace) -> None:
    """Apply the size flags to ``config`` in place, refusing those the family has no field for."""
    family = family_name(adapter, config)
    if args.num_layers is not None:
        if adapter.set_num_layers is None:
            raise ConfigError(f"--num-layers: {family} has per-stage depths; edit them in a --model-config instead")
        try:
            adapter.set_num_layers(config, args.num_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if adapter.per_stage_sizes and any(v is not None for v in (args.hidden_size, args.num_attention_heads)):
        raise ConfigError(f"--hidden-size/--num-attention-heads: {family} has per-stage sizes; use a --model-config")
    derived_head_dim = _head_dim_is_derived(config)
    if args.hidden_size is not None:
        config.hidden_size = args.hidden_size  # attribute_map turns this into n_embd / d_model where needed
    if args.num_attention_heads is not None:
        config.num_attention_heads = args.num_attention_heads
    if derived_head_dim and config.hidden_size % config.num_attention_heads == 0:
        config.head_dim = config.hidden_size // config.num_attention_heads  # it followed the sizes: it still does
    if args.num_query_groups is not None:
        if adapter.kv_heads_field is None or not hasattr(config, adapter.kv_heads_field):
            raise ConfigError(f"--num-query-groups: {family} has no grouped-query attention")
        setattr(config, adapter.kv_heads_field, args.num_query_groups)
    if args.ffn_hidden_size is not None:
        if adapter.ffn_size_field is None or not hasattr(config, adapter.ffn_size_field):
            raise ConfigError(f"--ffn-hidden-size: {family} has no feed-forward size field")
        setattr(config, adapter.ffn_size_field, args.ffn_hidden_size)
    if args.vocab_size is not None:
        config.vocab_size = args.vocab_size
    if args.max_position_embeddings is not None:
        config.max_position_embeddings = args.max_position_embeddings
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if adapter.head_dim_from_hidden and heads and hidden and hidden % heads:
        raise ConfigError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}")
    kv = getattr(config, adapter.kv_heads_field, None) if adapter.kv_heads_field else None
    if kv and heads and heads % kv:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {kv}")


def _head_dim_is_derived(config: Any) -> bool:
    """The config stores a head size that its constructor derived from hidden size and heads (Llama-style configs),
    so a size flag must derive it again."""
    head_dim, hidden, heads = (getattr(config, f, None) for f in ("head_dim", "hidden_size", "num_attention_heads"))
    return bool(head_dim and hidden and heads and head_dim * heads == hidden)


def seq_lengths(config: Any, adapter: FamilyAdapter, args: argparse.Namespace) -> tuple[int, int | None]:
    """(sequence length, decoder sequence length): 0 for image models (the image fixes it), None without a decoder."""
    seq2seq = adapter.task is Task.SEQ2SEQ_LM
    if args.decoder_seq_length is not None and not seq2seq:
        family = family_name(adapter, config)
        raise ConfigError(f"--decoder-seq-length: {family} has no decoder stream; use --seq-length")
    if adapter.task is Task.IMAGE_CLASSIFICATION:
        if args.seq_length is not None:
            family = family_name(adapter, config)
            raise ConfigError(f"--seq-length: {family} takes images; its sequence follows image and patch size")
        return 0, None
    default = min(1024, getattr(config, "max_position_embeddings", None) or 1024)
    seq = args.seq_length or default
    for flag, length in (("--seq-length", seq), ("--decoder-seq-length", args.decoder_seq_length)):
        if length is not None and length < 2:
            raise ConfigError(f"{flag} must be >= 2, got {length}")
    return seq, (args.decoder_seq_length or seq) if seq2seq else None


def layer_specs(config: Any, adapter: FamilyAdapter, seq: int, decoder_seq: int | None) -> list[LayerSpec]:
    """The adapter's per-layer facts; a model the adapter cannot run at this length is a :class:`ConfigError`."""
    try:
        if decoder_seq is not None:
            return adapter.layer_specs(config, seq, decoder_seq)
        return adapter.layer_specs(config, seq)
    except ValueError as err:
        raise ConfigError(str(err)) from None
