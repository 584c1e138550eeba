"""Synthetic data for benchmarks: every batch is a function of (seed, step) and the batch shape only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from galva_models.data.loader import Batch

_MASK_PROBABILITY = 0.15


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step)`` alone, so any rank can rebuild any step's batch."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    # Mix with a large odd constant so (seed, step) pairs never collide for realistic ranges.
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + step) % (2**63))


@dataclass(frozen=True)
class RandomTokenSource:
    """Causal-LM batches of uniform random tokens: ``inputs = t[:, :-1]``, ``labels = t[:, 1:]``."""

    vocab_size: int
    seq_length: int
    global_batch_size: int
    seed: int = 1234

    def batch(self, step: int) -> Batch:
        tokens = torch.randint(
            0, self.vocab_size, (self.global_batch_size, self.seq_length + 1), generator=step_generator(self.seed, step)
        )
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


@dataclass(frozen=True)
class RandomMaskedTokenSource:
    """Masked-LM batches: 15% of positions replaced by ``mask_token_id`` and scored; the rest labelled -100."""

    vocab_size: int
    seq_length: int
    global_batch_size: int
    mask_token_id: int
    seed: int = 1234

    def batch(self, step: int) -> Batch:
        gen = step_generator(self.seed, step)
        shape = (self.global_batch_size, self.seq_length)
        tokens = torch.randint(0, self.vocab_size, shape, generator=gen)
        masked = torch.rand(shape, generator=gen) < _MASK_PROBABILITY
        masked[:, 0] = True  # at least one scored token per sample
        inputs = torch.where(masked, torch.full_like(tokens, self.mask_token_id), tokens)
        labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
        return Batch(inputs, labels)


@dataclass(frozen=True)
class RandomImageSource:
    """Image-classification batches: standard-normal pixels ``[B, C, H, W]`` and labels ``[B]``."""

    image_size: int
    num_channels: int
    num_labels: int
    global_batch_size: int
    seed: int = 1234

    def batch(self, step: int) -> Batch:
        gen = step_generator(self.seed, step)
        size = self.image_size
        pixels = torch.randn((self.global_batch_size, self.num_channels, size, size), generator=gen)
        labels = torch.randint(0, self.num_labels, (self.global_batch_size,), generator=gen)
        return Batch(pixels, labels)


class RandomSeq2SeqSource:
    """Encoder-decoder (T5) batches: ``inputs = [encoder ids ; labels shifted right]`` (the decoder's inputs, from
    the config's ``decoder_start_token_id``), ``labels`` random ``[B, decoder length]`` (see tables/t5.py)."""

    def __init__(self, config: Any, enc: int, dec: int, gbs: int, seed: int = 1234) -> None:
        self.config, self.enc, self.dec, self.global_batch_size, self.seed = config, enc, dec, gbs, seed

    def batch(self, step: int) -> Batch:
        gen = step_generator(self.seed, step)
        v = self.config.vocab_size
        enc = torch.randint(0, v, (self.global_batch_size, self.enc), generator=gen)
        labels = torch.randint(0, v, (self.global_batch_size, self.dec), generator=gen)
        start = torch.full((self.global_batch_size, 1), self.config.decoder_start_token_id or 0)
        return Batch(torch.cat([enc, start, labels[:, :-1]], dim=1), labels)


def random_source(
    task: str,
    config: Any,
    seq_length: int,
    global_batch_size: int,
    seed: int = 1234,
    decoder_seq_length: int | None = None,
) -> RandomTokenSource | RandomMaskedTokenSource | RandomSeq2SeqSource | RandomImageSource:
    """The seeded random source of a task (a :class:`galva_models.tables.family.Task` value) for a Hugging Face
    ``config``: next tokens, masked tokens (the config's mask token, else the last id), ``[encoder ; decoder]`` ids
    (``seq_length`` the encoder's, ``decoder_seq_length`` the decoder's, by default the same) or the config's images
    and labels (no sequence: the patches follow from the image)."""
    if task == "causal_lm":
        return RandomTokenSource(int(config.vocab_size), seq_length, global_batch_size, seed)
    if task == "masked_lm":
        mask_id = getattr(config, "mask_token_id", None) or config.vocab_size - 1
        return RandomMaskedTokenSource(int(config.vocab_size), seq_length, global_batch_size, int(mask_id), seed)
    if task == "seq2seq_lm":
        return RandomSeq2SeqSource(config, seq_length, decoder_seq_length or seq_length, global_batch_size, seed)
    if task == "image_classification":
        return RandomImageSource(config.image_size, config.num_channels, config.num_labels, global_batch_size, seed)
    raise ValueError(f"random_source: no random batches for task {task!r}")
