"""Parallel building blocks: autograd collectives, Megatron tp / Megatron-SP blocks, Ulysses attention, vocabulary
parallelism, and exact re-sharding of activations between layers.

- :mod:`.mappings`: ``copy_to_group``, ``reduce_from_group``, ``gather_along_dim``, ``reduce_scatter_along``,
  ``split_along_dim``, ``all_to_all`` (explicit groups, gloo-safe)
- :mod:`.tensor_parallel`: ``TensorParallelAttention``, ``TensorParallelMLP``, ``sequence_parallel_norm``
- :mod:`.ulysses`: ``UlyssesAttention``
- :mod:`.vocab`: ``VocabParallelEmbedding``, ``VocabParallelHead``, ``vocab_parallel_cross_entropy``
- :mod:`.redistribute`: ``redistribute`` / ``Redistribute`` executing a :class:`galva_comm.layout.RedistributionPlan`
"""
