"""Manifest of a layerwise, strategy-independent Galva checkpoint directory.

The directory holds ``manifest.json`` and, per module of the model (``embedding``, ``layers.<i>``, ``head``), one
safetensors file of full (unsharded) tensors under their Hugging Face on-disk names. Optimizer moments are stored
the same way, one file per module; the scheduler and data position are small JSON values in the manifest; RNG
states are one safetensors file of byte tensors. Every file other than the manifest has its size and sha256 in
``files``, so a reader can tell a complete checkpoint from a damaged one before using it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, model_validator

from galva_schema._base import GalvaFile, GalvaModel
from galva_schema.vocabulary import Precision


class TensorInfo(GalvaModel):
    shape: tuple[NonNegativeInt, ...]
    dtype: str = Field(description="torch dtype name without the 'torch.' prefix, e.g. 'float32'.")


class ModuleEntry(GalvaModel):
    """One module of the model (``embedding``, ``layers.3``, ``head``) stored in one safetensors file."""

    name: str
    file: str = Field(description="Path relative to the checkpoint directory.")
    tensors: dict[str, TensorInfo] = Field(
        description="Full (unsharded) tensors under their Hugging Face on-disk names (optimizer files: "
        "'<state>/<name>', e.g. 'exp_avg/model.norm.weight')."
    )


class FileInfo(GalvaModel):
    """Size and checksum of one file of the checkpoint."""

    size: NonNegativeInt = Field(description="Bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex SHA-256 of the whole file.")


class OptimizerState(GalvaModel):
    """Optimizer state, layerwise and unsharded: one safetensors file per model module, same module names."""

    kind: Literal["adamw"] = "adamw"
    step: NonNegativeInt = Field(description="Optimizer steps taken (AdamW bias correction).")
    hyperparameters: dict[str, float] = Field(
        default_factory=dict, description="e.g. lr, beta1, beta2, eps, weight_decay at the time of the save."
    )
    state_names: tuple[str, ...] = Field(
        ("exp_avg", "exp_avg_sq"), description="Per-parameter states; file tensors are named '<state>/<hf name>'."
    )
    modules: tuple[ModuleEntry, ...]


class CheckpointManifest(GalvaFile):
    """``manifest.json`` of a checkpoint directory: every module's file and full tensor shapes."""

    kind: Literal["galva.checkpoint"] = "galva.checkpoint"
    model_family: str = Field(description="Adapter name, e.g. 'llama' or 'gpt2'.")
    model_config_dict: dict[str, Any] = Field(
        default_factory=dict, alias="model_config", description="The Hugging Face config as a dict."
    )
    num_layers: NonNegativeInt
    modules: tuple[ModuleEntry, ...]
    step: NonNegativeInt | None = Field(None, description="Training step, for training checkpoints.")
    has_optimizer_state: bool = False
    tied: dict[str, str] = Field(
        default_factory=dict,
        description="Hugging Face name stored once under another name (weight tying): alias -> stored name.",
    )
    files: dict[str, FileInfo] = Field(
        default_factory=dict, description="Every file of the directory but manifest.json: relative path -> check."
    )
    hf_files: tuple[str, ...] = Field(
        (), description="Hugging Face side files kept verbatim under 'hf/' (tokenizer, generation config, ...)."
    )
    optimizer: OptimizerState | None = None
    scheduler: dict[str, Any] | None = Field(
        None,
        description="Learning-rate scheduler state (JSON values); galva-train adds the schedule it ran under "
        "('schedule': train_iters, lr, min_lr, warmup_iters, decay_style), which a resume must repeat.",
    )
    mixed_precision: Precision | None = Field(
        None,
        description="Compute precision of the training run that saved it (the tensors are its fp32 masters either "
        "way): a resume keeps it unless given another.",
    )
    data_position: dict[str, Any] | None = Field(
        None, description="Where the data stream resumes, e.g. {'consumed_samples': 4096}."
    )
    rng_file: str | None = Field(
        None, description="Safetensors file of RNG states as uint8 tensors, e.g. 'rank0/cpu', 'rank0/cuda'."
    )

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointManifest:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("modules: module names repeat")
        stored = {t for m in self.modules for t in m.tensors}
        for alias, target in self.tied.items():
            if alias in stored or target not in stored:
                raise ValueError(f"tied: {alias} -> {target} must name an unstored alias and a stored tensor")
        if self.files:
            listed = [m.file for m in self.modules]
            listed += [m.file for m in self.optimizer.modules] if self.optimizer else []
            listed += [f"hf/{name}" for name in self.hf_files] + ([self.rng_file] if self.rng_file else [])
            missing = [f for f in listed if f not in self.files]
            if missing:
                raise ValueError(f"files: no checksum for {missing[0]}")
        if self.has_optimizer_state != (self.optimizer is not None):
            raise ValueError("has_optimizer_state must say whether 'optimizer' is given")
        return self
