"""Load a Hugging Face directory (``galva-ckpt g2h``'s output) with plain ``transformers`` and generate from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Generation", "generate"]


@dataclass(frozen=True)
class Generation:
    prompt: str
    text: str  # the prompt followed by the generated continuation
    new_tokens: int
    model_class: str
    num_parameters: int


def generate(model_dir: str | os.PathLike[str], prompt: str, max_new_tokens: int = 16) -> Generation:
    """Greedy generation (deterministic) of ``max_new_tokens`` tokens after ``prompt``; local files only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (not a Hugging Face model directory)")
    tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,  # a fixed number of new tokens, even if the model predicts the end of a document
        )
    new = int(out.shape[1] - inputs["input_ids"].shape[1])
    text = str(tokenizer.decode(out[0], skip_special_tokens=True))
    return Generation(prompt, text, new, type(model).__name__, sum(p.numel() for p in model.parameters()))
