"""Named model configurations, built in code (nothing is downloaded): ``galva-train --model PRESET``.

Sizes follow the published models. The ``tiny-*`` presets are a few-thousand-parameter versions of each family
for tests and smoke runs on CPU; they have
no dropout, so a run is deterministic and a parallel plan can be compared with one process step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _gpt2(n_embd: int, n_layer: int, n_head: int, **kw: Any) -> Any:
    from transformers import GPT2Config

    fields = dict(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=1024, vocab_size=50257)
    return GPT2Config(**{**fields, **kw})


def _llama(kind: str, **kw: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind]
    return cls(**kw)


def _bert(**kw: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(**kw)


def _t5(**kw: Any) -> Any:
    from transformers import T5Config

    return T5Config(**kw)


def _vit(**kw: Any) -> Any:
    from transformers import ViTConfig

    return ViTConfig(**kw)


def _swin(**kw: Any) -> Any:
    from transformers import SwinConfig

    return SwinConfig(**kw)


def _tiny_llama(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        extra: dict[str, Any] = {"sliding_window": None} if kind == "mistral" else {}
        return _llama(
            kind,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            **extra,
        )

    return build


PRESETS: dict[str, Callable[[], Any]] = {
    "gpt2-small": lambda: _gpt2(768, 12, 12),
    "gpt2-medium": lambda: _gpt2(1024, 24, 16),
    "gpt2-large": lambda: _gpt2(1280, 36, 20),
    "gpt2-xl": lambda: _gpt2(1600, 48, 25),
    "llama2-7b": lambda: _llama(
        "llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "llama2-13b": lambda: _llama(
        "llama",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "llama2-70b": lambda: _llama(
        "llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-7b": lambda: _llama(
        "qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mistral-7b": lambda: _llama(
        "mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=None,
    ),
    "bert-large": lambda: _bert(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        vocab_size=30522,
    ),
    "t5-3b": lambda: _t5(
        d_model=1024,
        d_ff=16384,
        d_kv=128,
        num_heads=32,
        num_layers=24,
        num_decoder_layers=24,
        vocab_size=32128,
    ),
    "vit-huge": lambda: _vit(
        hidden_size=1280,
        num_hidden_layers=32,
        num_attention_heads=16,
        intermediate_size=5120,
        image_size=224,
        patch_size=14,
        num_labels=1000,
    ),
    "swin-huge": lambda: _swin(
        embed_dim=352,
        depths=[2, 2, 18, 2],
        num_heads=[11, 22, 44, 88],
        window_size=7,
        image_size=224,
        num_labels=1000,
    ),
    # tiny versions of every family, for tests and CPU smoke runs
    "tiny-gpt2": lambda: _gpt2(
        64,
        4,
        4,
        n_positions=256,
        vocab_size=128,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "tiny-llama": _tiny_llama("llama"),
    "tiny-mistral": _tiny_llama("mistral"),
    "tiny-qwen2": _tiny_llama("qwen2"),
    "tiny-bert": lambda: _bert(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "tiny-t5": lambda: _t5(
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=2,
        vocab_size=128,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.0,
    ),
    "tiny-vit": lambda: _vit(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=16,
        patch_size=4,
        num_labels=10,
    ),
    "tiny-swin": lambda: _swin(
        embed_dim=16,
        depths=[1, 1, 2, 1],
        drop_path_rate=0.0,
        num_heads=[2, 2, 4, 4],
        window_size=2,
        image_size=32,
        patch_size=2,
        num_labels=10,
    ),
}


class UnknownPresetError(ValueError):
    pass


def preset_config(name: str) -> Any:
    """A fresh transformers config for preset ``name``."""
    try:
        build = PRESETS[name]
    except KeyError:
        raise UnknownPresetError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
    return build()
