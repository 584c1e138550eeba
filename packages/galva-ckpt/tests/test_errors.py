"""A wrong, foreign or damaged input ends in one line naming the file and tensor, exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def _fails(run, *needles: str) -> None:
    """Exit 2, one stderr line 'galva-ckpt: error: ...' containing every needle, no traceback."""
    assert run.code == 2, run
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("galva-ckpt: error: "), run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def galva(tmp_path: Path, cli, tiny) -> Path:
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    return tmp_path / "galva"


def test_checkpoint_of_another_model(tmp_path: Path, cli, tiny) -> None:
    """llama's config.json next to gpt2's weights: the first foreign tensor is named."""
    tiny.save(tmp_path / "gpt2", "tiny-gpt2")
    tiny.save(tmp_path / "llama", "tiny-llama")
    shutil.copy(tmp_path / "gpt2" / "model.safetensors", tmp_path / "llama" / "model.safetensors")
    run = cli("h2g", tmp_path / "llama", tmp_path / "out")
    _fails(run, "llama/model.safetensors: tensor transformer.", "not part of the llama model", "another model")
    assert not (tmp_path / "out").exists()


def test_shape_that_does_not_match_the_config(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    run = cli("h2g", tmp_path / "hf", tmp_path / "out")
    _fails(run, "model.safetensors: tensor transformer.wte.weight has shape [128, 64]", "implies [100, 64]")


def test_manifest_whose_shapes_do_not_match_its_config(galva: Path, tmp_path: Path, cli) -> None:
    manifest = json.loads((galva / "manifest.json").read_text())
    manifest["model_config"]["n_positions"] = 99
    (galva / "manifest.json").write_text(json.dumps(manifest))
    _fails(cli("g2h", galva, tmp_path / "back"), "embedding.safetensors: tensor transformer.wpe.weight has shape")


def test_missing_module_file(galva: Path, tmp_path: Path, cli) -> None:
    (galva / "model" / "layers.2.safetensors").unlink()
    _fails(cli("g2h", galva, tmp_path / "back"), "model/layers.2.safetensors: file missing")
    _fails(cli("info", galva), "layers.2.safetensors: file missing")
    assert not (tmp_path / "back").exists()


def test_missing_shard_and_missing_tensor(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-llama", max_shard_size="30KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "hf" / shard).unlink()
    _fails(cli("h2g", tmp_path / "hf", tmp_path / "out"), f"{shard}: file not found")

    tiny.save(tmp_path / "one", "tiny-llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "one" / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "one" / "model.safetensors", metadata={"format": "pt"})
    _fails(cli("h2g", tmp_path / "one", tmp_path / "out"), "tensor model.layers.3.mlp.down_proj.weight missing")


def test_corrupt_module_file_is_a_checksum_mismatch(galva: Path, tmp_path: Path, cli) -> None:
    path = galva / "model" / "layers.1.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside a tensor: the file still parses, only the checksum sees it
    path.write_bytes(bytes(data))
    _fails(cli("info", galva), "model/layers.1.safetensors: checksum mismatch")
    _fails(cli("g2h", galva, tmp_path / "back"), "model/layers.1.safetensors: checksum mismatch")
    assert not (tmp_path / "back").exists()
    assert not list(tmp_path.glob("back.tmp-*"))  # the temporary output was removed


def test_truncated_file(galva: Path, tmp_path: Path, cli) -> None:
    path = galva / "model" / "head.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    _fails(cli("g2h", galva, tmp_path / "back"), "head.safetensors: size", "truncated")


def test_corrupt_hf_file(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-bert")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _fails(cli("h2g", tmp_path / "hf", tmp_path / "out"), "model.safetensors: not a readable safetensors file")


def test_bad_manifest(galva: Path, tmp_path: Path, cli) -> None:
    (galva / "manifest.json").write_text('{"kind": "galva.strategy"}')
    _fails(cli("g2h", galva, tmp_path / "back"), "manifest.json", "kind")
    (galva / "manifest.json").unlink()
    _fails(cli("info", galva), "manifest.json: missing")


def test_no_config(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-vit")
    (tmp_path / "hf" / "config.json").unlink()
    _fails(cli("h2g", tmp_path / "hf", tmp_path / "out"), "config.json: file not found")


def test_unknown_model_type(tmp_path: Path, cli, tiny) -> None:
    tiny.save(tmp_path / "hf", "tiny-vit")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mamba2000"}))
    _fails(cli("h2g", tmp_path / "hf", tmp_path / "out"), "config.json", "mamba2000")


def test_refuses_a_non_empty_output_unless_forced(galva: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "back"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(cli("g2h", galva, out), "back: directory is not empty; pass --force")
    assert (out / "keep.txt").read_text() == "mine"
    assert cli("g2h", galva, out, "--force").code == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "galva", "hf"]  # no .tmp-/.old- leftovers


@pytest.mark.parametrize(("out", "problem"), [("/proc/galva-out", "No such file or directory"),
                                               ("{tmp}/file/out", "Not a directory"),
                                               ("{tmp}/file", "exists and is not a directory")])  # fmt: skip
def test_an_output_that_cannot_be_created_is_named(tmp_path: Path, cli, tiny, out: str, problem: str) -> None:
    """Issue #22: the line names the output asked for, not the temporary directory beside it."""
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    (tmp_path / "file").write_text("x")
    out = out.format(tmp=tmp_path)
    _fails(cli("h2g", tmp_path / "hf", out), f"galva-ckpt: error: {out}: {problem}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "hf"] and (tmp_path / "file").read_text() == "x"


def test_output_inside_the_input_is_refused(galva: Path, cli) -> None:
    _fails(cli("g2h", galva, galva / "hf_out"), "must not be, contain or lie inside the input")


def test_failed_forced_replace_keeps_the_old_output(galva: Path, tmp_path: Path, cli) -> None:
    assert cli("g2h", galva, tmp_path / "back").code == 0
    before = (tmp_path / "back" / "model.safetensors").read_bytes()
    (galva / "model" / "head.safetensors").unlink()
    _fails(cli("g2h", galva, tmp_path / "back", "--force"), "head.safetensors: file missing")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == before


def test_bad_shard_size_is_a_usage_error(galva: Path, tmp_path: Path, cli) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli("g2h", galva, tmp_path / "back", "--max-shard-size", "lots")
    assert exit_info.value.code == 2


def _rewrite(galva: Path, relative: str, data: bytes) -> None:
    """Replace a module file and record its new size and sha256 in the manifest: only its content is wrong."""
    import hashlib

    (galva / relative).write_bytes(data)
    manifest = json.loads((galva / "manifest.json").read_text())
    manifest["files"][relative] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (galva / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", ["header", "length"])
def test_info_reads_every_header(galva: Path, cli, damage: str) -> None:
    """A file whose checksum matches the manifest but whose safetensors header does not parse: info said 'OK'."""
    relative = "model/layers.1.safetensors"
    data = bytearray((galva / relative).read_bytes())
    size = int.from_bytes(data[:8], "little")
    if damage == "header":
        data[8 : 8 + size] = b"{" + b" " * (size - 1)  # cut JSON, same length
    else:
        data[:8] = (10**12).to_bytes(8, "little")  # a header longer than the file
    _rewrite(galva, relative, bytes(data))
    _fails(cli("info", galva), f"{relative}: not a readable safetensors file")


def test_info_compares_every_header_with_the_manifest(galva: Path, cli) -> None:
    from safetensors.torch import load_file, save_file

    relative = "model/head.safetensors"
    tensors = load_file(galva / relative)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name][:1].clone()  # a valid file that holds another shape than the manifest says
    save_file(tensors, galva / relative, metadata={"format": "pt"})
    _rewrite(galva, relative, (galva / relative).read_bytes())
    _fails(cli("info", galva), f"{relative}: tensor {name} is [1", "manifest says")
    ok = cli("info", galva, "--no-verify")  # reads the manifest only, as it says
    assert ok.code == 0 and "checksums    not verified" in ok.out
