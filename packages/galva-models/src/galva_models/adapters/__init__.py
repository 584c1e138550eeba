"""Model-family adapters: Hugging Face model -> :class:`galva_hp.model.LayeredModel`.

One module per family; :mod:`galva_models.adapters.registry` maps a config's ``model_type`` to its adapter.
"""

from galva_models.adapters.base import FamilyAdapter, LayerSpec, Task, parameter_name_map
from galva_models.adapters.registry import adapter_for, build_layered, family_names

__all__ = ["FamilyAdapter", "LayerSpec", "Task", "adapter_for", "build_layered", "family_names", "parameter_name_map"]
