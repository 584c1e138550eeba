"""Shared fixtures: a tokenizer trained by the test itself and a small JSONL corpus."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "in",
    "green",
    "trees",
    "near",
    "old",
    "stone",
    "walls",
    "and",
    "bright",
    "rivers",
    "run",
    "past",
    "quiet",
    "towns",
    "under",
    "blue",
    "skies",
    "every",
    "long",
    "summer",
    "day",
]


def make_corpus(path: Path, documents: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(documents)]
    with path.open("w") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": i, "text": text}) + "\n")
            if i == 5:
                handle.write("\n")  # blank lines are skipped
    return texts


def train_tokenizer(directory: Path, texts: list[str]) -> Path:
    """A WordLevel tokenizer trained on ``texts``, saved as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>", "<mask>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", mask_token="<mask>")
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def corpus_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    texts = make_corpus(root / "corpus.jsonl")
    tokenizer_dir = train_tokenizer(root / "tokenizer", texts)
    return root / "corpus.jsonl", tokenizer_dir, texts
