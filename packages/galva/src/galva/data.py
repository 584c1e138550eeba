"""A small corpus and a tokenizer made on this machine: nothing is fetched from a model hub.

* :func:`write_corpus`: a deterministic synthetic English-like corpus (JSONL, one document per line) from a small
  grammar: subjects, verbs, objects, places and times combined by a seeded generator, so a tiny model's loss falls
  visibly within a few dozen steps and the same seed gives the same bytes everywhere.
* :func:`train_tokenizer`: a byte-level BPE trained with the ``tokenizers`` library on that corpus and saved as a
  Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) that
  ``galva-data preprocess`` and ``transformers.AutoTokenizer`` read.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from galva_schema import write_text_atomic

__all__ = ["BOS", "EOS", "PAD", "documents", "train_tokenizer", "write_corpus"]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

_SUBJECTS = ("the cat", "a small dog", "the old farmer", "my sister", "the red fox", "a young bird", "the teacher",
             "our neighbour", "the tired horse", "a curious child", "the baker", "the captain")
_VERBS = ("sees", "follows", "finds", "carries", "watches", "paints", "feeds", "greets", "chases", "remembers")
_OBJECTS = ("the green apple", "a wooden box", "the quiet river", "an open door", "the yellow kite", "a warm loaf",
            "the broken cart", "a long letter", "the silver key", "the tall tree")
_PLACES = ("in the garden", "near the market", "by the sea", "on the hill", "behind the house", "at the station",
           "under the bridge", "in the forest")
_TIMES = ("every morning", "after lunch", "at night", "on sunday", "before the rain", "in the spring")
_LINKS = ("and then", "because", "while", "so")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_PLACES))
    if rng.random() < 0.4:
        words.append(rng.choice(_TIMES))
    if rng.random() < 0.3:
        words += [rng.choice(_LINKS), rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    return " ".join(words) + " ."


def documents(num_documents: int, seed: int = 0) -> Iterator[str]:
    """``num_documents`` documents of 3 to 8 sentences each, a function of ``seed`` only."""
    rng = random.Random(seed)
    for _ in range(num_documents):
        yield " ".join(_sentence(rng).capitalize() for _ in range(rng.randint(3, 8)))


def write_corpus(path: str | os.PathLike[str], num_documents: int = 2000, seed: int = 0) -> Path:
    """Write the corpus as JSONL (``{"text": ...}`` per line), atomically."""
    if num_documents < 1:
        raise ValueError(f"num_documents: {num_documents} must be at least 1")
    text = "".join(json.dumps({"text": doc}) + "\n" for doc in documents(num_documents, seed))
    return write_text_atomic(path, text)


def _texts(corpus: Path, key: str) -> Iterator[str]:
    with corpus.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield str(json.loads(line)[key])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{corpus}:{lineno}: no '{key}' text ({type(err).__name__})") from None


def train_tokenizer(corpus: str | os.PathLike[str], out_dir: str | os.PathLike[str], vocab_size: int = 1024,
                    json_key: str = "text") -> int:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (specials included) on a JSONL corpus and save it as
    a Hugging Face tokenizer directory. Returns the vocabulary size actually reached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size: {vocab_size} is below the 256 byte tokens plus the specials")
    source = Path(corpus)
    if not source.is_file():
        raise ValueError(f"{source}: no such file")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(source, json_key), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # saved beside the output, then each file moved in whole: an interruption never leaves a half-written file, and
    # nothing else in the output directory is touched
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.tmp-", dir=out.resolve().parent))
    try:
        fast.save_pretrained(str(tmp))
        for item in sorted(tmp.iterdir()):
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return int(tokenizer.get_vocab_size())
