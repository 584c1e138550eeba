"""Every family: save_pretrained -> h2g -> g2h -> from_pretrained gives identical tensors and logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from galva_ckpt import CheckpointReader

PRESETS = ["tiny-gpt2", "tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-bert", "tiny-t5", "tiny-vit", "tiny-swin"]
PRESETS += ["tiny-mixtral"]  # fused expert tensors in memory, one per expert and projection (w1, w3, w2) on disk


def _tokenizer(directory: Path) -> None:
    """A real (word-level) fast tokenizer saved next to the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)


@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_is_exact(preset: str, tmp_path: Path, cli, tiny) -> None:
    model = tiny.save(tmp_path / "hf", preset)
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0

    back = type(model).from_pretrained(tmp_path / "back", local_files_only=True, attn_implementation="eager").eval()
    original, restored = model.state_dict(), back.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original), preset
    with torch.no_grad():
        batch = tiny.inputs(model)
        assert torch.equal(model(**batch).logits, back(**batch).logits)
    # the output is what save_pretrained writes: same tensor names, same bytes per tensor
    assert (
        load_file(tmp_path / "back" / "model.safetensors").keys()
        == load_file(tmp_path / "hf" / "model.safetensors").keys()
    )


def test_layout_one_file_per_module_under_hf_names(tmp_path: Path, cli, tiny) -> None:
    """GPT-2: embedding, each layer, head; the tied lm_head is stored once (as wte) and declared in the manifest."""
    model = tiny.save(tmp_path / "hf", "tiny-gpt2")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    reader = CheckpointReader(tmp_path / "galva")
    manifest = reader.manifest
    assert reader.module_names == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert manifest.num_layers == 4 and manifest.model_family == "gpt2"
    assert manifest.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert set(reader.read_module("embedding")) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert set(reader.read_module("head")) == {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    layer2 = reader.read_module("layers.2")
    assert all(name.startswith("transformer.h.2.") for name in layer2)
    state = model.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in layer2.items())
    assert manifest.model_config_dict == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert set(manifest.files) == {m.file for m in manifest.modules} | {"hf/generation_config.json"}


def test_tied_llama_and_t5_store_the_shared_weight_once(tmp_path: Path, cli, tiny) -> None:
    model = tiny.model("tiny-llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    manifest = CheckpointReader(tmp_path / "galva").manifest
    assert manifest.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    stored = [name for m in manifest.modules for name in m.tensors]
    assert "lm_head.weight" not in stored and stored.count("model.embed_tokens.weight") == 1
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    back = type(model).from_pretrained(tmp_path / "back", local_files_only=True)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied again, as HF expects
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)


def test_tokenizer_and_generation_files_come_back(tmp_path: Path, cli, tiny) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tiny.save(tmp_path / "hf", "tiny-llama")
    _tokenizer(tmp_path / "hf")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    names = {p.name for p in (tmp_path / "back").iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    for name in names - {"model.safetensors", "config.json"}:
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back", local_files_only=True)
    assert tokenizer("hello world")["input_ids"] == [1, 2]
    assert GenerationConfig.from_pretrained(tmp_path / "back", local_files_only=True) is not None


def test_without_side_files_only_config_and_weights(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-bert")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    assert {p.name for p in (tmp_path / "back").iterdir()} == {p.name for p in (tmp_path / "hf").iterdir()}


def test_a_tied_alias_saved_anyway_is_dropped(tmp_path: Path, cli, tiny) -> None:
    """Older writers store lm_head.weight next to wte: h2g keeps one copy, Hugging Face re-ties on load."""
    from safetensors.torch import save_file

    model = tiny.save(tmp_path / "hf", "tiny-gpt2")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    stored = [n for m in CheckpointReader(tmp_path / "galva").manifest.modules for n in m.tensors]
    assert "lm_head.weight" not in stored
    assert cli("g2h", tmp_path / "galva", tmp_path / "back").code == 0
    back = type(model).from_pretrained(tmp_path / "back", local_files_only=True)
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)


def test_g2h_and_info_take_a_save_directorys_newest_complete_save(tmp_path: Path, cli, tiny) -> None:
    """A galva-train --save directory, as --load takes it: step-2 (complete) over step-1, step-3 (no manifest,
    killed half-way) named in a warning and skipped; its tokenizer comes back with the weights."""
    from transformers import AutoTokenizer

    root = tmp_path / "save"
    models = {}
    for step, seed in ((1, 0), (2, 1)):
        models[step] = tiny.model("tiny-llama", seed=seed)
        models[step].save_pretrained(tmp_path / f"hf{step}")
        _tokenizer(tmp_path / f"hf{step}")
        assert cli("h2g", tmp_path / f"hf{step}", root / f"step-{step:08d}").code == 0
    (root / "step-00000003").mkdir()
    (root / "step-00000003" / "model").mkdir()  # a save that died before its manifest

    info = cli("info", root)
    assert info.code == 0, info.err
    assert f"checkpoint   {root / 'step-00000002'}" in info.out and "tokenizer.json" in info.out
    assert "ignoring incomplete save" in info.err and "step-00000003" in info.err

    run = cli("g2h", root, tmp_path / "back")
    assert run.code == 0, run.err
    assert f"(from {root / 'step-00000002'}, the newest complete save)" in run.out
    back = type(models[2]).from_pretrained(tmp_path / "back", local_files_only=True)
    assert all(torch.equal(t, back.state_dict()[k]) for k, t in models[2].state_dict().items())
    assert not torch.equal(models[1].state_dict()["lm_head.weight"], back.state_dict()["lm_head.weight"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back", local_files_only=True)
    assert tokenizer("hello world")["input_ids"] == [1, 2]

    for step in (1, 2):
        (root / f"step-{step:08d}" / "manifest.json").unlink()
    for command in (("info", root), ("g2h", root, tmp_path / "back2")):
        run = cli(*command)
        assert run.code == 2 and run.err.splitlines()[-1] == (
            f"galva-ckpt: error: {root}: no complete save (every step-* directory lacks its manifest.json)"
        )
