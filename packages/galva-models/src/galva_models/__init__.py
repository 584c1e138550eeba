"""galva-models: Hugging Face model adapters, datasets and the ``galva-train`` / ``galva-data`` commands.

- :mod:`galva_models.tables`: every causal-LM family whose config carries transformers' tensor-parallel and
  pipeline tables (llama, mistral, qwen2/3, gemma 1-3, phi, olmo, granite, ...), and Galva's table entries for
  gpt2, bert, vit and swin, cut where it stands and parallelized in place; no family code.
- :mod:`galva_models.adapters`: the adapter of the family without a table entry yet (t5), which decomposes a
  transformers model into a :class:`galva_hp.model.LayeredModel` and gives its parallel forms.
- :mod:`galva_models.data`: random data (a function of seed and step only), Megatron indexed datasets, and the
  global-batch contract with galva-hp's runtime.
- :mod:`galva_models.attention`: attention backend selection (SDPA default, flash-attn optional).
- :mod:`galva_models.cli`: ``galva-train`` (config parsing and validation in ``cli.config``) and ``galva-data``.
"""

__version__ = "0.1.0"
