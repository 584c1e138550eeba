"""galva-train's console progress: a bar on a terminal only; redirected, plain lines (galva_schema.progress)."""

from __future__ import annotations

import subprocess
import sys


def test_a_redirected_galva_train_writes_no_bar_frames(tmp_path) -> None:
    """The case of the issue: galva-train's progress on, stderr a file: 30 steps give a few plain lines, not 11 KB of
    tqdm frames."""
    code = (
        "from galva_models.metrics import MetricsLogger\n"
        "log = MetricsLogger(total_steps=30, progress=True, log_interval=10)\n"
        "for s in range(30):\n"
        "    log.log({'step': s + 1, 'loss': 1.0, 'lr': 1e-3, 'grad_norm': 1.0, 'step_time_s': 0.01,\n"
        "             'tokens_per_s': 100.0})\n"
        "log.close()\n"
    )
    with (tmp_path / "err.log").open("w") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True, timeout=300)
    text = (tmp_path / "err.log").read_text()
    assert "\r" not in text and len(text) < 2000, text
    assert [line.split(" |")[0] for line in text.splitlines() if line.startswith("step")] == [
        "step     10", "step     20", "step     30"
    ]  # fmt: skip
