"""Tiny real Hugging Face checkpoints for galva-ckpt's tests, and a helper that runs the command in-process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from galva_ckpt.cli import main
from galva_models import adapter_for
from galva_models.presets import preset_config


@dataclass
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """``cli("h2g", a, b)`` runs ``galva-ckpt`` in this process (progress bar off unless asked)."""

    def run(*args: Any, progress: bool = False) -> Run:
        argv = [str(a) for a in args]
        if not progress and argv[0] in ("h2g", "g2h"):
            argv.append("--no-progress")
        capsys.readouterr()  # drop what the test's own setup printed (save_pretrained's bar)
        code = main(argv)
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


class Tiny:
    """Helpers, handed to tests by the ``tiny`` fixture (test modules cannot import conftest in importlib mode)."""

    @staticmethod
    def model(preset: str, seed: int = 0, **overrides: Any) -> Any:
        """A tiny model of a galva-models preset, with weights from ``seed`` and every value distinct."""
        config = preset_config(preset)
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(seed)
        model = adapter_for(config).build_model(config, attn_implementation="eager")
        with torch.no_grad():  # norms start at exactly 1 and biases at 0: randomise so a swapped tensor shows
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        return model.eval()

    @staticmethod
    def save(directory: Path, preset: str = "tiny-gpt2", **save_kw: Any) -> Any:
        """``save_pretrained`` a tiny model into ``directory``; returns the model."""
        model = Tiny.model(preset)
        model.save_pretrained(directory, **save_kw)
        return model

    @staticmethod
    def inputs(model: Any) -> dict[str, torch.Tensor]:
        """A forward batch fitting the model's task."""
        config = model.config
        generator = torch.Generator().manual_seed(1)
        if config.model_type in ("vit", "swin"):
            size = config.image_size
            return {"pixel_values": torch.randn(2, config.num_channels, size, size, generator=generator)}
        ids = torch.randint(0, config.vocab_size, (2, 8), generator=generator)
        if config.model_type == "t5":
            return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
        return {"input_ids": ids}


@pytest.fixture
def tiny() -> type[Tiny]:
    return Tiny
