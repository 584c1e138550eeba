"""Data: preprocess a generated corpus with a test-trained tokenizer, read it back exactly; random data determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from galva_models.cli.data import main as data_main
from galva_models.data import (
    Batch,
    IndexedTokenSource,
    RandomImageSource,
    RandomMaskedTokenSource,
    RandomTokenSource,
    TokenWindows,
    dp_share,
    micro_batches,
)
from galva_models.data.preprocess import load_tokenizer, preprocess


def _expected(tokenizer_dir, texts, append_eod):
    tok = load_tokenizer(tokenizer_dir)
    docs = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if append_eod else []) for t in texts]
    return [d for d in docs if d]


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_round_trip_exact(tmp_path, corpus_and_tokenizer, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus, tokenizer_dir, texts = corpus_and_tokenizer
    prefix = tmp_path / "out" / "data"
    result = preprocess(corpus, tokenizer_dir, prefix, append_eod=True, workers=workers, progress=False)
    expected = _expected(tokenizer_dir, texts, append_eod=True)
    assert result.documents == len(expected) and result.tokens == sum(map(len, expected))
    ds = IndexedDataset(str(prefix))
    assert len(ds) == len(expected)
    for i, doc in enumerate(expected):
        assert ds[i].tolist() == doc
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["data.bin", "data.idx"]  # no temporaries left


def test_cli_preprocess_and_windows(tmp_path, corpus_and_tokenizer, capsys):
    corpus, tokenizer_dir, texts = corpus_and_tokenizer
    prefix = tmp_path / "cli"
    argv = ["preprocess", "--input", str(corpus), "--json-key", "text", "--tokenizer", str(tokenizer_dir)]
    assert data_main([*argv, "--output-prefix", str(prefix), "--quiet"]) == 0
    assert "documents" in capsys.readouterr().out
    stream = [t for doc in _expected(tokenizer_dir, texts, append_eod=False) for t in doc]
    windows = TokenWindows(str(prefix), seq_length=16, seed=3)
    assert windows.num_tokens == len(stream)
    # every window is a contiguous slice of the token stream (spanning documents), each visited once per epoch
    starts = []
    for i in range(windows.num_windows):
        w = windows.window(i).tolist()
        start = next(s for s in range(0, len(stream), 16) if stream[s : s + 17] == w)
        starts.append(start)
    assert sorted(starts) == list(range(0, 16 * windows.num_windows, 16))
    again = TokenWindows(str(prefix), seq_length=16, seed=3)
    assert all(np.array_equal(again.window(i), windows.window(i)) for i in (0, 5, windows.num_windows + 1))
    source = IndexedTokenSource(str(prefix), seq_length=16, global_batch_size=4, seed=3)
    batch = source.batch(1)
    assert batch.inputs.shape == (4, 16) and torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1])
    assert batch.inputs[0].tolist() == windows.window(4)[:-1].tolist()


def test_preprocess_errors(tmp_path, corpus_and_tokenizer):
    corpus, tokenizer_dir, _ = corpus_and_tokenizer
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b"}\n{"body": "c"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no key 'text'"):
        preprocess(bad, tokenizer_dir, tmp_path / "x", progress=False)
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".x*"))
    argv = ["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "nope"), "--output-prefix", "y"]
    assert data_main(argv) == 1


def test_random_tokens_depend_only_on_seed_and_step():
    a = RandomTokenSource(vocab_size=50, seq_length=8, global_batch_size=4, seed=7)
    b = RandomTokenSource(vocab_size=50, seq_length=8, global_batch_size=4, seed=7)
    assert torch.equal(a.batch(3).inputs, b.batch(3).inputs)
    assert not torch.equal(a.batch(3).inputs, a.batch(4).inputs)
    assert not torch.equal(a.batch(3).inputs, RandomTokenSource(50, 8, 4, seed=8).batch(3).inputs)
    batch = a.batch(0)
    assert torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1]) and int(batch.inputs.max()) < 50
    torch.manual_seed(0)  # global RNG state does not matter
    assert torch.equal(a.batch(3).labels, b.batch(3).labels)
    masked = RandomMaskedTokenSource(50, 8, 4, mask_token_id=2, seed=1).batch(0)
    scored = masked.labels != -100
    assert scored[:, 0].all() and (masked.inputs[scored] == 2).all()
    images = RandomImageSource(8, 3, 10, 4, seed=1)
    assert torch.equal(images.batch(2).inputs, images.batch(2).inputs) and images.batch(2).labels.shape == (4,)


def test_dp_share_and_micro_batches_partition_the_global_batch():
    batch = Batch(torch.arange(24).view(8, 3), torch.arange(8))
    shares = [dp_share(batch, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s.inputs for s in shares]), batch.inputs)
    micros = micro_batches(shares[1], 2)
    assert [m.labels.tolist() for m in micros] == [[2], [3]]
    with pytest.raises(ValueError, match="cannot be split over data-parallel degree 3"):
        dp_share(batch, 0, 3)


@pytest.mark.parametrize(
    ("preset", "inputs", "labels"),
    [("tiny-llama", (4, 16), (4, 16)), ("tiny-bert", (4, 16), (4, 16)), ("tiny-t5", (4, 16 + 6), (4, 6)),
     ("tiny-vit", (4, 3, 16, 16), (4,))],
)
def test_every_task_has_a_random_source(preset, inputs, labels):
    """galva-train and galva-profile check draw the same random batches for a task: tokens, masked tokens (some
    scored, the rest -100), [encoder ; decoder] ids, images (check read a ViT's config for a vocabulary and failed)."""
    from galva_models.data import random_source
    from galva_models.presets import preset_config
    from galva_models.tables.registry import adapter_for

    config = preset_config(preset)
    batch = random_source(adapter_for(config).task.value, config, 16, 4, seed=3, decoder_seq_length=6).batch(0)
    assert tuple(batch.inputs.shape) == inputs and tuple(batch.labels.shape) == labels
    if preset == "tiny-bert":
        assert (batch.labels == -100).any() and (batch.labels != -100).any()
    with pytest.raises(ValueError, match="no random batches for task 'speech'"):
        random_source("speech", config, 16, 4)
