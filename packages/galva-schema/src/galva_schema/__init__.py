"""galva-schema: the typed file contracts that join Galva's profiler, search, runtime and checkpoints.

Every file carries ``schema_version`` and ``kind``; unknown keys are errors; a bad file raises
:class:`SchemaError` with one line naming the file, the field and the layer.

The names below are imported on first use (PEP 562): ``galva-search`` reads a hardware and a model profile and should
not pay, at start-up, for the modules and models of checkpoints, run checks or calibrations it never opens.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time they come from __getattr__
    from galva_schema._base import GalvaFile, load_json_object
    from galva_schema.calibration import Calibration, CalibrationPoint, MemoryFactors, TimeFactors
    from galva_schema.checkpoint import CheckpointManifest, ModuleEntry, TensorInfo
    from galva_schema.cluster import ClusterSpec
    from galva_schema.constraints import (
        LayerTypeConstraints,
        ModelConstraints,
        ParallelForm,
        SharedParameter,
        plan_problems,
    )
    from galva_schema.errors import SchemaError
    from galva_schema.file_types import FILE_TYPES
    from galva_schema.files import output_problem, write_bytes_atomic, write_json_atomic, write_text_atomic
    from galva_schema.hardware import AllreduceBandwidth, CallExtra, CollectiveTimes, HardwareProfile, P2PBandwidth
    from galva_schema.model_profile import (
        AttentionCoreProfile,
        BatchTime,
        CollectiveCall,
        ExpertProfile,
        LayerTypeProfile,
        ModelProfile,
        SequenceTime,
        StaticTime,
        VocabForm,
        VocabMemory,
        VocabPart,
        VocabProfile,
    )
    from galva_schema.run_check import Agreement, RunCheck
    from galva_schema.search_summary import LayerRun, SearchCounts, SearchSummary, SummaryVocab, TimeBreakdown
    from galva_schema.strategy import MAX_BATCH_SIZE, LayerStrategy, Strategy, VocabStrategy, even_division
    from galva_schema.vocabulary import (
        SCHEMA_VERSION,
        DataParallelType,
        GroupKind,
        PipelineSchedule,
        Precision,
        TimeModelForm,
    )

__version__ = "0.1.0"

_HOMES: dict[str, str] = {
    name: module
    for module, names in {
        "_base": ("GalvaFile", "load_json_object"),
        "calibration": ("Calibration", "CalibrationPoint", "MemoryFactors", "TimeFactors"),
        "checkpoint": ("CheckpointManifest", "ModuleEntry", "TensorInfo"),
        "cluster": ("ClusterSpec",),
        "constraints": ("LayerTypeConstraints", "ModelConstraints", "ParallelForm", "SharedParameter", "plan_problems"),
        "errors": ("SchemaError",),
        "file_types": ("FILE_TYPES",),
        "files": ("output_problem", "write_bytes_atomic", "write_json_atomic", "write_text_atomic"),
        "hardware": ("AllreduceBandwidth", "CallExtra", "CollectiveTimes", "HardwareProfile", "P2PBandwidth"),
        "model_profile": (
            "AttentionCoreProfile", "BatchTime", "CollectiveCall", "ExpertProfile", "LayerTypeProfile", "ModelProfile",
            "SequenceTime", "StaticTime", "VocabForm", "VocabMemory", "VocabPart", "VocabProfile",
        ),
        "run_check": ("Agreement", "RunCheck"),
        "search_summary": ("LayerRun", "SearchCounts", "SearchSummary", "SummaryVocab", "TimeBreakdown"),
        "strategy": ("MAX_BATCH_SIZE", "LayerStrategy", "Strategy", "VocabStrategy", "even_division"),
        "vocabulary": (
            "SCHEMA_VERSION", "DataParallelType", "GroupKind", "PipelineSchedule", "Precision", "TimeModelForm",
        ),
    }.items()
    for name in names
}  # fmt: skip
"""The module of galva_schema that defines each public name."""

__all__ = [
    "FILE_TYPES",
    "MAX_BATCH_SIZE",
    "SCHEMA_VERSION",
    "Agreement",
    "AllreduceBandwidth",
    "AttentionCoreProfile",
    "BatchTime",
    "Calibration",
    "CalibrationPoint",
    "CallExtra",
    "CheckpointManifest",
    "ClusterSpec",
    "CollectiveCall",
    "CollectiveTimes",
    "DataParallelType",
    "ExpertProfile",
    "GalvaFile",
    "GroupKind",
    "HardwareProfile",
    "LayerRun",
    "LayerStrategy",
    "LayerTypeConstraints",
    "LayerTypeProfile",
    "MemoryFactors",
    "ModelConstraints",
    "ModelProfile",
    "ModuleEntry",
    "P2PBandwidth",
    "ParallelForm",
    "PipelineSchedule",
    "Precision",
    "RunCheck",
    "SchemaError",
    "SearchCounts",
    "SearchSummary",
    "SequenceTime",
    "SharedParameter",
    "StaticTime",
    "Strategy",
    "SummaryVocab",
    "TensorInfo",
    "TimeBreakdown",
    "TimeFactors",
    "TimeModelForm",
    "VocabForm",
    "VocabMemory",
    "VocabPart",
    "VocabProfile",
    "VocabStrategy",
    "even_division",
    "load_json_object",
    "output_problem",
    "plan_problems",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any misspelt name

    def __getattr__(name: str) -> Any:
        """Import a public name's module on first use and keep the name here, so the next lookup is plain."""
        module = _HOMES.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
