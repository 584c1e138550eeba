"""Streaming: converting a checkpoint holds about one module in memory, not the model (peak RSS, subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from galva_models.checkpoint_names import checkpoint_names_from_dict

# gpt2-shaped, ~150 MB in fp32: 12 layers of ~12.6 MB, embedding ~8.4 MB, so a module is < 1/10 of the model
CONFIG = {"model_type": "gpt2", "n_embd": 512, "n_layer": 12, "n_head": 8, "n_positions": 64, "vocab_size": 4096}

# One fresh process runs h2g, g2h, then the control (a whole-model load), each measured as the peak resident
# memory above the level just before it, sampled every millisecond from /proc/self/statm.
_CHILD = """
import json, os, sys, threading, time
from galva_ckpt.cli import main
from galva_models.checkpoint_names import checkpoint_names_from_dict
from safetensors.torch import load_file
checkpoint_names_from_dict(json.loads(sys.argv[1]))  # warm-up: imports and first meta model build
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def peak_growth(job):
    base, peak, done = rss(), [0], []
    def sample():
        while not done:
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)
    thread = threading.Thread(target=sample)
    thread.start()
    held = job()
    done.append(1)
    thread.join()
    del held
    return (max(peak[0], rss()) - base) / 2**20

hf, galva, back = sys.argv[2:5]
print("growth", peak_growth(lambda: main(["h2g", hf, galva, "--no-progress"])))
print("growth", peak_growth(lambda: main(["g2h", galva, back, "--no-progress"])))
print("growth", peak_growth(lambda: {k: t.clone() for k, t in load_file(hf + "/model.safetensors").items()}))
"""


def _peak_growths_mib(hf: Path, galva: Path, back: Path) -> list[float]:
    argv = [sys.executable, "-c", _CHILD, json.dumps(CONFIG), str(hf), str(galva), str(back)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("growth ")]


def test_peak_memory_is_a_module_not_the_model(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(CONFIG))
    tensors = {
        name: torch.full(shape, 0.5)
        for m in checkpoint_names_from_dict(CONFIG).modules
        for name, shape in m.shapes.items()
    }
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    total_mib = sum(t.nbytes for t in tensors.values()) / 2**20
    del tensors
    assert total_mib > 140

    h2g, g2h, control = _peak_growths_mib(hf, tmp_path / "galva", tmp_path / "back")
    assert control > 0.8 * total_mib, (control, total_mib)  # the measurement sees a whole-model load
    assert h2g < 0.25 * total_mib, (h2g, total_mib)
    assert g2h < 0.25 * total_mib, (g2h, total_mib)
    print(f"peak growth MiB: h2g {h2g:.1f}, g2h {g2h:.1f}, whole-model load {control:.1f}, model {total_mib:.1f}")
