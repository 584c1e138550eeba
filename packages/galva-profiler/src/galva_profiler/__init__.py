"""galva-profiler: measure the hardware and the model, and write the profiles galva-search plans with.

- ``galva-profile hardware`` (under torchrun): collective bandwidths by group size and layout, collective times
  against message size with alpha-beta fits, p2p bandwidth by pipeline degree, compute/communication overlap
  -> :class:`galva_schema.HardwareProfile` (:mod:`galva_profiler.hardware`).
- ``galva-profile model``: per layer type forward/backward time over batch sizes and sequence lengths, parameter
  bytes, saved-activation bytes per tp degree / Megatron-SP / Ulysses / checkpointing, vocabulary time and memory
  -> :class:`galva_schema.ModelProfile` (:mod:`galva_profiler.model_profile`; needs the ``model`` extra).
"""

__version__ = "0.1.0"
