"""Tokenise a JSONL corpus with a local Hugging Face tokenizer into a Megatron indexed dataset (.bin/.idx).

Every line of the input is one JSON object; the text under ``json_key`` becomes one document. The tokenizer is
loaded from a local directory only (nothing is fetched). Output goes through megatron-core's
``IndexedDatasetBuilder`` into temporary files that are renamed to ``PREFIX.bin`` / ``PREFIX.idx`` only when
complete, so an interrupted run never leaves a half-written dataset behind.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CHUNK = 64
_tokenizer: Any = None  # per worker process


@dataclass(frozen=True)
class PreprocessResult:
    bin_path: Path
    idx_path: Path
    documents: int
    tokens: int


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """A Hugging Face tokenizer from a local directory (``local_files_only``; never touches the network)."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if not path.exists():
        raise FileNotFoundError(f"{path}: tokenizer directory does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: is not a directory (expected a tokenizer directory)")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:  # transformers' messages run over several lines: the first says it
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].strip()
        if first.endswith(":"):  # "Couldn't instantiate the backend tokenizer from one of:" and a list below it
            first = "no tokenizer files it can read (tokenizer.json, or tokenizer_config.json with its vocabulary)"
        raise ValueError(f"{path}: cannot load a tokenizer: {first}") from None


def _init_worker(directory: str) -> None:
    from galva_schema.interrupt import forked_worker

    forked_worker()  # Ctrl-C is the parent's to handle (one line, its temporary files removed); SIGTERM ends a worker
    global _tokenizer
    _tokenizer = load_tokenizer(directory)


def _encode(item: tuple[int, str, bool]) -> list[int]:
    _line_no, text, append_eod = item
    ids = list(_tokenizer(text, add_special_tokens=False)["input_ids"])
    if append_eod:
        ids.append(_eod_id(_tokenizer))
    return ids


def _eod_id(tokenizer: Any) -> int:
    eod = tokenizer.eos_token_id
    if eod is None:
        eod = tokenizer.sep_token_id
    if eod is None:
        raise ValueError("--append-eod: the tokenizer defines neither an eos_token nor a sep_token")
    return int(eod)


def _documents(path: Path, json_key: str, append_eod: bool) -> Iterator[tuple[int, str, bool]]:
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {err.msg}") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{path}:{line_no}: no key {json_key!r}")
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: {json_key!r} is {type(text).__name__}, expected a string")
            yield line_no, text, append_eod


def preprocess(
    input_path: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    *,
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenise ``input_path`` into ``output_prefix.bin`` / ``.idx``. See the module docstring."""
    import numpy as np
    import torch

    from galva_hp.megatron_import import import_megatron

    indexed_dataset = import_megatron("megatron.core.datasets.indexed_dataset")
    DType, IndexedDatasetBuilder = indexed_dataset.DType, indexed_dataset.IndexedDatasetBuilder

    from galva_schema.progress import progress_bar

    source = Path(input_path)
    if source.is_dir():
        raise IsADirectoryError(f"{source}: is a directory (expected a JSONL corpus)")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: input corpus does not exist")
    tokenizer = load_tokenizer(tokenizer_dir)
    if append_eod:
        _eod_id(tokenizer)  # fail before reading the corpus
    dtype = DType.optimal_dtype(len(tokenizer))
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    tmp_bin = bin_path.with_name(f".{bin_path.name}.{os.getpid()}.tmp")
    tmp_idx = idx_path.with_name(f".{idx_path.name}.{os.getpid()}.tmp")
    documents = tokens = 0
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        items = _documents(source, json_key, append_eod)
        bar = progress_bar(None, f"tokenising {source.name}", unit="doc", enabled=progress)
        with bar:
            if workers > 1:
                ctx = mp.get_context("fork" if sys.platform != "win32" else "spawn")
                from galva_schema.interrupt import forking

                with forking():  # no worker runs this process's signal handlers (see _init_worker)
                    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir),))
                with pool:
                    encoded = pool.imap(_encode, items, chunksize=_CHUNK)  # ordered: output is deterministic
                    documents, tokens = _write(builder, encoded, bar, torch, np)
            else:
                global _tokenizer
                _tokenizer = tokenizer
                documents, tokens = _write(builder, map(_encode, items), bar, torch, np)
        builder.finalize(str(tmp_idx))
        if documents == 0:  # a dataset of nothing would only fail later, in galva-train
            raise ValueError(
                f"{source}: no document has any token under --json-key {json_key!r}: nothing to train on; "
                f"no dataset written"
            )
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return PreprocessResult(bin_path, idx_path, documents, tokens)


def _write(builder: Any, encoded: Any, bar: Any, torch: Any, np: Any) -> tuple[int, int]:
    documents = tokens = 0
    for ids in encoded:
        if not ids:
            continue  # an empty document has no tokens to store; Megatron skips it too
        builder.add_document(torch.from_numpy(np.asarray(ids, dtype=np.int64)), [len(ids)])
        documents += 1
        tokens += len(ids)
        bar.set_postfix(tokens=tokens)
        bar.update(1)
    return documents, tokens
