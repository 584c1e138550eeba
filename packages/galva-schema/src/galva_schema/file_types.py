"""The table of every top-level file type (its own module so that ``import galva_schema`` builds none of them)."""

from __future__ import annotations

from galva_schema._base import GalvaFile
from galva_schema.calibration import Calibration
from galva_schema.checkpoint import CheckpointManifest
from galva_schema.cluster import ClusterSpec
from galva_schema.hardware import HardwareProfile
from galva_schema.model_profile import ModelProfile
from galva_schema.run_check import RunCheck
from galva_schema.search_summary import SearchSummary
from galva_schema.strategy import Strategy

FILE_TYPES: dict[str, type[GalvaFile]] = {
    "strategy": Strategy,
    "hardware_profile": HardwareProfile,
    "model_profile": ModelProfile,
    "cluster": ClusterSpec,
    "checkpoint_manifest": CheckpointManifest,
    "calibration": Calibration,
    "search_summary": SearchSummary,
    "run_check": RunCheck,
}
"""Every top-level file type, by the name used for its JSON Schema under ``docs/schemas/``."""
