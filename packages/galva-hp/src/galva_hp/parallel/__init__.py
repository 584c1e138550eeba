"""Parallel building blocks: autograd collectives, Megatron tp / Megatron-SP blocks, Ulysses attention, vocabulary
parallelism, and exact re-sharding of activations between layers.

- :mod:`.mappings`: autograd collectives ``differentiable_copy_to_group``, ``differentiable_reduce_from_group``,
  ``differentiable_all_gather``, ``differentiable_reduce_scatter``, ``differentiable_split``,
  ``differentiable_all_to_all``, and their plain (non-autograd) counterparts (explicit groups, gloo-safe)
- :mod:`.tensor_parallel`: ``TensorParallelAttention``, ``TensorParallelMLP``, ``sequence_parallel_norm`` (from
  :mod:`.tp_regions`, :mod:`.sp_norms`, :mod:`.tp_attention`, :mod:`.tp_mlp`, :mod:`.gather_state`)
- :mod:`.ulysses`: ``UlyssesAttention``
- :mod:`.ring_attention`: ``ring_attention`` (context parallelism: key/value blocks round a ring, lean backward)
- :mod:`.vocab`: ``VocabParallelEmbedding``, ``VocabParallelHead``, ``vocab_parallel_cross_entropy``
- :mod:`.redistribute`: ``redistribute`` / ``Redistribute`` executing a :class:`galva_comm.layout.RedistributionPlan`
"""
