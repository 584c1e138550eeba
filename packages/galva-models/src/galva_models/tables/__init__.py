"""Any Hugging Face family from its own tables: the model cut where it stands and parallelized in place.

transformers 5 states each model's parallel structure as data (``base_model_tp_plan``, ``base_model_pp_plan``) and
routes every attention call through a registry; this package reads both, so a family with tables needs no Galva
code (:mod:`.adapter`). Families without tables get one entry in :data:`.plans.GALVA_TABLES`.
"""

from galva_models.tables.adapter import ADAPTER, ADAPTERS, adapter_for, supports
from galva_models.tables.plans import GALVA_TABLES, ModelTables, model_tables

__all__ = ["ADAPTER", "ADAPTERS", "GALVA_TABLES", "ModelTables", "adapter_for", "model_tables", "supports"]
