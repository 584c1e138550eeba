"""Per-step training log: console progress bar, ``--metrics-jsonl`` (one JSON object per step), TensorBoard.

Only the rank that owns the logger writes (galva-train gives one to global rank 0). Each record holds at least
``step, loss, lr, grad_norm, step_time_s, tokens_per_s``, plus ``tflops`` (model FLOP/s estimate per rank, see
:func:`train_flops_per_token`), ``peak_memory_mib``, and ``base_memory_mib`` / ``peak_above_base_mib``
(:mod:`galva_hp.hooks`: the process before the model, and the peak over it). ``step`` counts from 1, as the
console and the checkpoints do: the record of step 1 is that of the first step, after which a save is
``step-00000001``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from galva_models.tables.family import LayerSpec


def train_flops_per_token(num_params: int, specs: Sequence[LayerSpec], recompute_fraction: float = 0.0) -> float:
    """Model FLOPs of one training token: ``6 N`` for the matmuls plus ``12 s h`` per layer for attention scores.

    ``recompute_fraction`` is the share of layers recomputed in backward (adds one more forward, ``2 N + 4 s h``,
    for those layers). The estimate counts multiply-adds as 2 FLOPs, like Megatron's and PaLM's MFU formulas.
    """
    attention = sum(12.0 * s.seq_length * s.hidden_size for s in specs)
    dense = 6.0 * num_params
    return (dense + attention) * (1.0 + recompute_fraction / 3.0)


class MetricsLogger:
    """Writes step records to the console, a JSONL file and TensorBoard (each optional)."""

    def __init__(
        self,
        *,
        total_steps: int,
        jsonl_path: str | os.PathLike[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        progress: bool = True,
        log_interval: int = 1,
        resume_step: int | None = None,
    ) -> None:
        """``resume_step``: the run continues a checkpoint after that many steps; the JSONL file keeps the earlier
        run's records of steps up to it and is appended to (None: a fresh run, the file starts anew)."""
        self.log_interval = max(1, log_interval)
        self._jsonl = None
        self._jsonl_path = jsonl_path
        if jsonl_path is not None:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = "w"
            if resume_step is not None and path.is_file():
                keep_steps_up_to(path, resume_step)
                mode = "a"
            self._jsonl = path.open(mode, buffering=1)  # line-buffered: a crash keeps every finished step
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("galva-train: tensorboard is not installed; --tensorboard-dir ignored", file=sys.stderr)
            else:
                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        self._bar = None
        if progress:  # a bar on a terminal; redirected, a plain line every few seconds (galva_schema.progress)
            from galva_schema.progress import progress_bar

            self._bar = progress_bar(total_steps, "train", unit="step")

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if self._jsonl is not None:
            try:
                self._jsonl.write(json_line(record))
                self._jsonl.flush()
            except OSError as err:  # a full disk: metrics are not worth a dead run
                print(
                    f"galva-train: warning: --metrics-jsonl {self._jsonl_path}: cannot write step {step} "
                    f"({err.strerror or err}); no more metrics are written, training goes on",
                    file=sys.stderr,
                )
                with contextlib.suppress(OSError):
                    self._jsonl.close()
                self._jsonl = None
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, step)
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}"
            )
            self._bar.update(1)
            if step % self.log_interval == 0:
                self._bar.write(_console_line(record))
        elif step % self.log_interval == 0:
            print(_console_line(record), file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            with contextlib.suppress(OSError):  # reported by log() already if the disk is full
                self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the records of ``path`` for steps ``> step`` (the steps a resumed run does again) and any line that is
    not a whole record (cut short by a crash); the file is rewritten atomically, and only if something goes."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) <= step]
    if kept != lines:
        from galva_schema import write_text_atomic

        write_text_atomic(path, "".join(kept))


def _step_of(line: str) -> float:
    """A whole record's step; infinity (never kept) for a line that is not one."""
    if not line.endswith("\n"):
        return math.inf  # the last line of a run killed mid-write
    try:
        record = json.loads(line)
    except ValueError:
        return math.inf
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else math.inf


def json_value(value: Any) -> Any:
    """A record value as strict JSON: a non-finite float becomes the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (bare NaN is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def json_line(record: dict[str, Any]) -> str:
    """One ``--metrics-jsonl`` line: strict JSON (see :func:`json_value`)."""
    return json.dumps({key: json_value(value) for key, value in record.items()}, allow_nan=False) + "\n"


def _console_line(r: dict[str, Any]) -> str:
    norm = r.get("grad_norm")
    mem = r.get("peak_memory_mib")
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | grad_norm "
        f"{'-' if norm is None else f'{norm:.3f}'} | {r['step_time_s'] * 1e3:.0f} ms | "
        f"{r['tokens_per_s']:.0f} tok/s | {r.get('tflops', 0.0):.3g} TFLOP/s | mem "
        f"{'-' if mem is None else f'{mem:.0f} MiB'}"
    )
