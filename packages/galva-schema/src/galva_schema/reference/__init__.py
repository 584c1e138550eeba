"""Explicit converters from and to the reference system's (Galvatron's) files.

Galva never reads a reference file by accident: these functions are the only way in or out, each documents the key
mapping and the defaults it applies, and every bad or missing entry raises a one-line
:class:`~galva_schema.SchemaError` naming the file and the key.

* Strategies (``galvatron_config_*.json``): :func:`read_galvatron_strategy`, :func:`to_galvatron_strategy`,
  :func:`write_galvatron_strategy`.
* Hardware profiles (``allreduce_bandwidth_*``, ``p2p_bandwidth_*``, ``sp_time_*``, ``overlap_coefficient.json``):
  :func:`read_galvatron_hardware`, :func:`to_galvatron_hardware`, :func:`write_galvatron_hardware`.
* Model profiles (``computation_profiling_*``, ``memory_profiling_*``): :func:`read_galvatron_model_profile`,
  :func:`to_galvatron_model_profile`, :func:`write_galvatron_model_profile`.
"""

from galva_schema.reference.fitting import polyfit
from galva_schema.reference.hardware import (
    GalvatronHardwareFiles,
    galvatron_hardware_file_names,
    read_galvatron_hardware,
    to_galvatron_hardware,
    write_galvatron_hardware,
)
from galva_schema.reference.model_profile import galvatron_model_profile_file_names, read_galvatron_model_profile
from galva_schema.reference.model_profile_writer import to_galvatron_model_profile, write_galvatron_model_profile
from galva_schema.reference.strategy import (
    PIPELINE_TYPES,
    read_galvatron_strategy,
    strategy_file_name,
    to_galvatron_strategy,
    write_galvatron_strategy,
)

__all__ = [
    "PIPELINE_TYPES",
    "GalvatronHardwareFiles",
    "galvatron_hardware_file_names",
    "galvatron_model_profile_file_names",
    "polyfit",
    "read_galvatron_hardware",
    "read_galvatron_model_profile",
    "read_galvatron_strategy",
    "strategy_file_name",
    "to_galvatron_hardware",
    "to_galvatron_model_profile",
    "to_galvatron_strategy",
    "write_galvatron_hardware",
    "write_galvatron_model_profile",
    "write_galvatron_strategy",
]
