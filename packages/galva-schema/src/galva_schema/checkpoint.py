"""Manifest of a layerwise, strategy-independent Galva checkpoint directory."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, NonNegativeInt

from galva_schema._base import GalvaFile, GalvaModel


class TensorInfo(GalvaModel):
    shape: tuple[NonNegativeInt, ...]
    dtype: str = Field(description="torch dtype name without the 'torch.' prefix, e.g. 'float32'.")


class ModuleEntry(GalvaModel):
    """One module of the model (``embedding``, ``layers.3``, ``norm``, ``head``) stored in one safetensors file."""

    name: str
    file: str = Field(description="Path relative to the checkpoint directory.")
    tensors: dict[str, TensorInfo] = Field(description="Full (unsharded) tensors, Galva names relative to module.")


class CheckpointManifest(GalvaFile):
    """``manifest.json`` of a checkpoint directory: every module's file and full tensor shapes."""

    KIND: ClassVar[str] = "galva.checkpoint"

    schema_version: Literal[1] = 1
    kind: Literal["galva.checkpoint"] = "galva.checkpoint"
    model_family: str = Field(description="Adapter name, e.g. 'llama' or 'gpt2'.")
    model_config_dict: dict[str, Any] = Field(
        default_factory=dict, alias="model_config", description="The Hugging Face config as a dict."
    )
    num_layers: NonNegativeInt
    modules: tuple[ModuleEntry, ...]
    step: NonNegativeInt | None = Field(None, description="Training step, for training checkpoints.")
    has_optimizer_state: bool = False
