"""What the table path tells galva-train, galva-hp and galva-ckpt about a model (:class:`FamilyAdapter`), and the
functions every family shares (parameter names, weight ties, coverage, initialisation).

A :class:`FamilyAdapter` is data plus small functions, the same for every family of a task (:mod:`.adapter`), with
the fields a table entry sets itself (:data:`~.plans.GALVA_TABLES`' ``adapter``): its task (what a batch looks
like), how to build the Hugging Face model, how to cut it into a :class:`galva_hp.model.LayeredModel`, which plans
it can run (a :class:`galva_schema.ModelConstraints`, checked by :func:`galva_schema.plan_problems` in galva-train
and in galva-hp's ``build`` alike) and its boundary shapes (:class:`LayerSpec`). The cut modules *hold the Hugging
Face submodules themselves* (no copies), so the single-process LayeredModel computes exactly what the Hugging Face
model computes, and the parameter-name mapping is found by tensor identity (:func:`parameter_name_map`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from galva_hp.model import LayeredModel
from galva_hp.shared_params import embedding_ties
from galva_models.tables.errors import UnsupportedModel
from galva_schema import ModelConstraints


class Task(str, Enum):
    """What the model learns; fixes the batch format (see :mod:`galva_models.data`)."""

    CAUSAL_LM = "causal_lm"  # inputs token ids [B, S]; labels next tokens [B, S]
    MASKED_LM = "masked_lm"  # inputs with mask tokens [B, S]; labels original tokens or -100 [B, S]
    SEQ2SEQ_LM = "seq2seq_lm"  # inputs [encoder ids ; decoder ids] [B, S_enc + S_dec]; labels [B, S_dec]
    IMAGE_CLASSIFICATION = "image_classification"  # inputs pixels [B, C, H, W]; labels [B]


@dataclass(frozen=True)
class LayerSpec:
    """The boundary activation of one transformer layer: ``[batch, seq_length, hidden_size]`` (batch first).

    The boundary dtype is the run's compute dtype. What a plan must respect (heads, forms) is in the adapter's
    :class:`~galva_schema.ModelConstraints`, not here.
    """

    layer_type: str
    seq_length: int
    hidden_size: int


@dataclass(frozen=True)
class FamilyAdapter:
    """What a model is to the commands (see the module docstring and docs/adding-a-model.md)."""

    name: str
    model_types: tuple[str, ...]
    task: Task
    build_model: Callable[..., nn.Module]
    """``(config, attn_implementation) -> Hugging Face model`` with its task head."""
    decompose: Callable[..., LayeredModel]
    """``(hf_model, **options) -> LayeredModel`` sharing the Hugging Face modules, with its constraints."""
    constraints: Callable[..., ModelConstraints]
    """``(config, seq_length=None, decoder_seq_length=None) -> ModelConstraints``: every plan rule of the model
    (heads, forms it cannot run and why, token counts a sequence split must divide, shared parameters). The
    lengths matter only where a layer's boundary sequence is not the run's sequence (an encoder-decoder)."""
    layer_specs: Callable[..., list[LayerSpec]]
    """``(config, seq_length[, decoder_seq_length]) -> one LayerSpec per transformer layer``; raises
    ``ValueError`` for a length the model cannot run."""
    set_num_layers: Callable[[Any, int], None] | None = None
    """Change the transformer layer count of a config (None: the family has no single layer count)."""

    # Config facts galva-train's size overrides need, so that no CLI code names a family.
    ffn_size_field: str | None = None
    """The config field ``--ffn-hidden-size`` sets (None: the family has no single feed-forward size)."""
    kv_heads_field: str | None = None
    """The config field ``--num-query-groups`` sets (None: no grouped-query attention)."""
    per_stage_sizes: bool = False
    """Hidden size and heads differ per stage: ``--hidden-size`` and ``--num-attention-heads`` are refused."""
    head_dim_from_hidden: bool = True
    """The head size is ``hidden_size / heads``, so the heads must divide the hidden size (False where the config
    sets the head size itself, like T5's ``d_kv``)."""


def length_options(task: Task, seq_length: int | None, decoder_seq_length: int | None = None) -> dict[str, int]:
    """What a model's ``decompose`` needs to know of the run's lengths: an encoder-decoder (:attr:`Task.SEQ2SEQ_LM`)
    the split of its ``[encoder ; decoder]`` stream (the decoder as long as the encoder unless given); any other
    model nothing. galva-train and galva-profile both ask this."""
    if task is not Task.SEQ2SEQ_LM or not seq_length:
        return {}
    return {"encoder_seq_length": seq_length, "decoder_seq_length": decoder_seq_length or seq_length}


def galva_named_parameters(model: LayeredModel) -> list[tuple[str, nn.Parameter]]:
    """Every (Galva name, parameter) of a LayeredModel, shared parameters listed under each holder."""
    out: list[tuple[str, nn.Parameter]] = []
    for prefix, module in model.galva_modules():
        out += [(f"{prefix}.{name}", p) for name, p in module.named_parameters(remove_duplicate=False)]
    return out


def parameter_name_map(hf_model: nn.Module, model: LayeredModel) -> dict[str, str]:
    """Galva parameter name -> Hugging Face parameter name, matched by tensor identity.

    Tied Hugging Face parameters (e.g. ``lm_head.weight`` and ``transformer.wte.weight``) map to the first name
    Hugging Face lists. Raises if a Galva parameter is not in the Hugging Face model (an adapter bug).
    """
    by_id: dict[int, str] = {}
    for name, param in hf_model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), name)
    out: dict[str, str] = {}
    for name, param in galva_named_parameters(model):
        if id(param) not in by_id:
            raise ValueError(f"{model.name}: parameter {name} does not belong to the Hugging Face model")
        out[name] = by_id[id(param)]
    return out


def shared_parameter_groups(model: LayeredModel) -> list[tuple[str, ...]]:
    """Galva names that refer to one tensor (weight tying), for every tensor held more than once."""
    groups: dict[int, list[str]] = {}
    for name, param in galva_named_parameters(model):
        groups.setdefault(id(param), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def check_full_coverage(hf_model: nn.Module, model: LayeredModel, unused: tuple[str, ...] = ()) -> None:
    """Every trainable Hugging Face parameter is held by the LayeredModel (except ``unused`` prefixes)."""
    held = {id(p) for _, p in galva_named_parameters(model)}
    missing = [
        n for n, p in hf_model.named_parameters() if id(p) not in held and not n.startswith(unused) and p.requires_grad
    ]
    if missing:
        raise UnsupportedModel(
            f"{model.name}: Hugging Face parameters not in any Galva module: {', '.join(missing[:5])}"
        )


def tie_and_check(hf_model: nn.Module, model: LayeredModel) -> LayeredModel:
    """The last step of every family's ``decompose``: declare ``model``'s embedding-to-head weight ties as shared
    weights (:func:`galva_hp.shared_params.embedding_ties`) and check that it holds every trainable parameter of
    ``hf_model`` (:func:`check_full_coverage`).
    """
    model.shared += embedding_ties(model.embedding, model.head)
    check_full_coverage(hf_model, model)
    return model


def hf_init_fn(hf_model: Any, seed: int) -> Callable[[str, nn.Module], None]:
    """galva-hp ``init_fn`` for a model built on the meta device: Hugging Face's own initialiser, module by module.

    Each Galva module (``"embedding"``, ``"layers.3"``, ``"head"``) is initialised from its own seed
    (``seed`` + CRC32 of the name), so every rank gets the same values without building the whole model; rotary
    buffers are recomputed by the same call. Shared weights' copies are made equal afterwards by galva-hp.
    """
    import zlib

    def init(name: str, module: nn.Module) -> None:
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        for sub in module.modules():
            hf_model._init_weights(sub)

    return init
