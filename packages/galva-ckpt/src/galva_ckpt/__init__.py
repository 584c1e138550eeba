"""galva-ckpt: layerwise, strategy-independent checkpoints for Galva, and Hugging Face conversion (h2g / g2h).

- :mod:`galva_ckpt.format`: the directory layout and dtype tables; the manifest is galva_schema's
  :class:`~galva_schema.CheckpointManifest`.
- :mod:`galva_ckpt.writing` / :mod:`galva_ckpt.reading`: streaming safetensors writer with inline sha256, lazy
  reads (one module, one slice), checksum checks, directories written under a temporary name.
- :mod:`galva_ckpt.checkpoint`: :class:`CheckpointWriter` and :class:`CheckpointReader`, the API training uses.
- :mod:`galva_ckpt.convert`: ``hf_to_galva`` and ``galva_to_hf``; :mod:`galva_ckpt.cli`: the ``galva-ckpt`` command.
"""

from galva_ckpt.checkpoint import CheckpointReader, CheckpointWriter
from galva_ckpt.errors import CheckpointError
from galva_ckpt.writing import atomic_directory

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter", "__version__", "atomic_directory"]
