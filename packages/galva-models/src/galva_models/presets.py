"""Named model configurations, built in code (nothing is downloaded): ``galva-train --model PRESET``.

Sizes follow the published models. The ``tiny-*`` presets are a few-thousand-parameter versions of each family
for tests and smoke runs on CPU; they have no dropout, so a run is deterministic and a parallel plan can be compared
with one process step by step.

Each family has one function: its positional arguments are the sizes (in the order the comment above the family's
presets gives), its defaults the published models' common values, and other keywords go to the transformers config
as they are. A preset is one call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from galva_models.tiny_layers import detach_overrides, keep_layers, layers_kept, per_layer_lists


def _gpt2(n_embd: int, n_layer: int, n_head: int, n_positions: int = 1024, vocab_size: int = 50257, **kw: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=n_positions, vocab_size=vocab_size, **kw
    )


def _sizes(hidden: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """The size fields of Llama-family, BERT and ViT configs."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn)


def _llama(
    kind: str, hidden: int, layers: int, heads: int, ffn: int, kv_heads: int, vocab: int, positions: int, **kw: Any
) -> Any:
    """``kind``: llama, mistral or qwen2. Mistral presets run without a sliding window (set
    ``sliding_window`` for one; every parallel form supports it)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    if kind == "mistral":
        kw = {"sliding_window": None, **kw}
    sizes = _sizes(hidden, layers, heads, ffn)
    return cls(**sizes, num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=positions, **kw)


def _tiny_llama(kind: str) -> Any:
    return _llama(kind, 64, 4, 4, 128, 2, 128, 256, tie_word_embeddings=False)


def _bert(hidden: int, layers: int, heads: int, ffn: int, vocab: int = 30522, **kw: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(**_sizes(hidden, layers, heads, ffn), vocab_size=vocab, **kw)


def _vit(hidden: int, layers: int, heads: int, ffn: int, patch_size: int, image_size: int = 224, **kw: Any) -> Any:
    from transformers import ViTConfig

    return ViTConfig(**_sizes(hidden, layers, heads, ffn), patch_size=patch_size, image_size=image_size, **kw)


def _t5(d_model: int, d_ff: int, d_kv: int, num_heads: int, num_layers: int, vocab_size: int = 32128, **kw: Any) -> Any:
    """Encoder and decoder have ``num_layers`` layers each."""
    from transformers import T5Config

    sizes: dict[str, Any] = dict(d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=num_heads, num_layers=num_layers)
    return T5Config(**sizes, num_decoder_layers=num_layers, vocab_size=vocab_size, **kw)


def _swin(embed_dim: int, depths: list[int], num_heads: list[int], window_size: int, **kw: Any) -> Any:
    from transformers import SwinConfig

    return SwinConfig(embed_dim=embed_dim, depths=depths, num_heads=num_heads, window_size=window_size, **kw)


PRESETS: dict[str, Callable[[], Any]] = {
    # gpt2: hidden, layers, heads[, positions, vocab]
    "gpt2-small": lambda: _gpt2(768, 12, 12),
    "gpt2-medium": lambda: _gpt2(1024, 24, 16),
    "gpt2-large": lambda: _gpt2(1280, 36, 20),
    "gpt2-xl": lambda: _gpt2(1600, 48, 25),
    # llama family: kind, hidden, layers, heads, ffn, kv heads, vocab, positions
    "llama2-7b": lambda: _llama("llama", 4096, 32, 32, 11008, 32, 32000, 4096, rms_norm_eps=1e-5),
    "llama2-13b": lambda: _llama("llama", 5120, 40, 40, 13824, 40, 32000, 4096, rms_norm_eps=1e-5),
    "llama2-70b": lambda: _llama("llama", 8192, 80, 64, 28672, 8, 32000, 4096, rms_norm_eps=1e-5),
    "qwen2.5-7b": lambda: _llama(
        "qwen2", 3584, 28, 28, 18944, 4, 152064, 32768, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False
    ),
    "mistral-7b": lambda: _llama("mistral", 4096, 32, 32, 14336, 8, 32000, 32768, rms_norm_eps=1e-5),
    # bert and vit: hidden, layers, heads, ffn[, bert: vocab]
    "bert-large": lambda: _bert(1024, 24, 16, 4096),
    "vit-huge": lambda: _vit(1280, 32, 16, 5120, patch_size=14, num_labels=1000),
    # t5: d_model, d_ff, d_kv, heads, layers (encoder and decoder each)[, vocab]
    "t5-3b": lambda: _t5(1024, 16384, 128, 32, 24),
    # swin: embed_dim, stage depths, stage heads, window size
    "swin-huge": lambda: _swin(352, [2, 2, 18, 2], [11, 22, 44, 88], 7, image_size=224, num_labels=1000),
    # tiny versions of every family, for tests and CPU smoke runs
    "tiny-gpt2": lambda: _gpt2(
        64, 4, 4, 256, 128, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "tiny-llama": lambda: _tiny_llama("llama"),
    "tiny-mistral": lambda: _tiny_llama("mistral"),
    "tiny-qwen2": lambda: _tiny_llama("qwen2"),
    "tiny-bert": lambda: _bert(
        64, 4, 4, 128, 128, max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ),
    "tiny-t5": lambda: _t5(64, 128, 16, 4, 2, 128, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0),
    "tiny-vit": lambda: _vit(64, 4, 4, 128, patch_size=4, image_size=16, num_labels=10),
    "tiny-swin": lambda: _swin(
        16, [1, 1, 2, 1], [2, 2, 4, 4], 2, image_size=32, num_labels=10, patch_size=2, drop_path_rate=0.0
    ),
}


TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
"""The sizes of ``tiny-<model_type>`` for a family that has no preset of its own: the tiny Llama's."""

TINY_EXPERTS: dict[str, Any] = dict(
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, output_router_logits=True, router_aux_loss_coef=0.05, n_group=2,
    topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16,
)  # fmt: skip
"""A tiny mixture of experts (set where the family's config has the field): 4 experts of width 32, 2 per token,
the router's load-balancing loss in the loss (weight 0.05); DeepSeek's group-limited routing over 2 groups (1
chosen), one dense first layer and small latent attention."""


class UnknownPresetError(ValueError):
    pass


def _resize(config: Any, field: str, value: Any) -> None:
    """Set a size; a field that holds one size per entry (per layer, per expert kind) gets ``value`` for each."""
    current = getattr(config, field)
    setattr(config, field, [value] * len(current) if isinstance(current, list) else value)


def tiny_sizes(config: Any, layers: int | None = TINY_SIZES["num_hidden_layers"]) -> Any:
    """A copy of ``config`` with :data:`TINY_SIZES` and :data:`TINY_EXPERTS` on the fields it has, every other field
    kept; ``layers`` of its layers (holding every kind it has, :func:`~.tiny_layers.layers_kept`), None: all."""
    config = copy.deepcopy(config)
    overrides = detach_overrides(config)  # a heterogeneous config's per-layer fields, back after the resize
    lists = per_layer_lists(config)
    total = config.num_hidden_layers
    kept = layers_kept(total, lists, overrides, total if layers is None else layers)
    defaults = config.to_dict()
    for field, value in TINY_SIZES.items():  # the fields the family has (GPT-2: no key/value heads, no head size)
        if hasattr(config, field) and field != "num_hidden_layers":
            _resize(config, field, value)
    for field, value in defaults.items():
        # a second token table's vocabulary (Gemma 3n's and Gemma 4's per-layer inputs: 262,144 rows x layers)
        if field.startswith("vocab_size_") and isinstance(value, int) and value > TINY_SIZES["vocab_size"]:
            setattr(config, field, TINY_SIZES["vocab_size"])
    experts = any(getattr(config, f, None) for f in ("num_local_experts", "num_experts", "n_routed_experts"))
    # DeepSeek-style fields left None by a default config that cannot be built so (Dots1's): an expert-parallel table
    # says the family has experts
    unset = bool(getattr(config, "base_model_ep_plan", None)) and hasattr(config, "n_routed_experts") and not experts
    for field, value in TINY_EXPERTS.items():
        # experts per token is needed wherever there are experts (DeepSeek-V2 leaves it None by default)
        if getattr(config, field, None) is not None or (field == "num_experts_per_tok" and experts):
            _resize(config, field, value)
        elif unset and field in ("n_routed_experts", "num_experts_per_tok"):
            setattr(config, field, value)
    if unset and getattr(config, "n_shared_experts", 0) is None:
        config.n_shared_experts = 1
    if getattr(config, "kv_lora_rank", None) is not None:  # latent attention expands keys to every head
        config.num_key_value_heads = config.num_attention_heads
    keep_layers(config, kept, list(lists), overrides, defaults)
    return config


def tiny_config(model_type: str, sliding_window: int | None = None) -> Any:
    """A tiny config of any transformers family (:func:`tiny_sizes` of the family's default config, so every other
    field keeps the family's default; dropout off). ``sliding_window``: the window of the family's windowed layers
    (None keeps its default)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UnknownPresetError(f"unknown model preset 'tiny-{model_type}': no transformers family {model_type!r}")
    config = tiny_sizes(CONFIG_MAPPING[model_type]())
    if sliding_window is not None and getattr(config, "sliding_window", None) is not None:
        config.sliding_window = sliding_window
    for field, value in config.to_dict().items():  # deterministic, like every tiny preset
        if isinstance(value, float) and ("dropout" in field or "pdrop" in field):
            setattr(config, field, 0.0)
    return config


def preset_config(name: str) -> Any:
    """A fresh transformers config for preset ``name`` (``tiny-<model_type>`` for any transformers family without a
    preset of its own: :func:`tiny_config`)."""
    build = PRESETS.get(name)
    if build is not None:
        return build()
    if name.startswith("tiny-"):
        return tiny_config(name.removeprefix("tiny-"))
    raise UnknownPresetError(
        f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}, and tiny-<model_type> for any "
        "transformers family"
    )
