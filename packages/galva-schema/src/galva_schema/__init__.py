"""galva-schema: the typed file contracts that join Galva's profiler, search, runtime and checkpoints.

Every file carries ``schema_version`` and ``kind``; unknown keys are errors; a bad file raises
:class:`SchemaError` with one line naming the file, the field and the layer.
"""

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
from galva_schema.files import output_problem, write_bytes_atomic, write_json_atomic, write_text_atomic
from galva_schema.hardware import AllreduceBandwidth, CollectiveTimes, HardwareProfile, P2PBandwidth
from galva_schema.model_profile import (
    AttentionCoreProfile,
    BatchTime,
    ExpertProfile,
    LayerTypeProfile,
    ModelProfile,
    SequenceTime,
    StaticTime,
    VocabMemory,
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
    "CheckpointManifest",
    "ClusterSpec",
    "CollectiveTimes",
    "DataParallelType",
    "ExpertProfile",
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
    "VocabMemory",
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
