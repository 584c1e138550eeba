"""``galva run``: the whole job on this machine, one stage after another, each stage one command a user could type.

    corpus → tokenizer → preprocess → model config → profile hardware → profile model → search → train (+ save)
    → export (g2h) → generate (transformers) → check (measured against predicted) → report

Every stage runs as a subprocess of the same Python (the commands of the other distributions, exactly as installed),
its output goes to ``OUT/logs/<stage>.log``, and ``galva run`` prints one line per stage with the time it took and
the command, so any stage can be re-run on its own. While a stage runs, the last line of its log (its step or
progress line) is shown: redrawn in place on a terminal, an indented line every 10 s otherwise. At the end it prints
where every artefact went and writes the same list as ``OUT/run.json``. A failing stage stops the run: its last log
lines are printed and the exit status is 1.
The check stage trains nothing: it reads the train stage's metrics (:mod:`galva.check`); when the step time or the
peak is outside its noise band it writes ``OUT/calibration.json``, which the next run's search takes with
``--calibration`` (a calibration inside ``--out`` is read before the directory is replaced).
Ctrl-C or SIGTERM is passed on to the stage running, which ends the same way (its line in its log, no temporary file
left); ``galva run`` then prints one line and exits with 130 / 143.

Resources: the local GPUs when there are some (NCCL, bf16), otherwise ``--nproc`` CPU ranks with gloo (fp32).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from galva_schema import output_problem, write_text_atomic
from galva_schema.interrupt import wait_child

__all__ = ["PipelineOptions", "StageResult", "detect_devices", "run_pipeline"]


CPU_MEMORY = "1300MiB"
"""The default budget per CPU rank: small enough that the search has to split the default model over the ranks."""


@dataclass(frozen=True)
class PipelineOptions:
    """What ``galva run`` does; the defaults finish in a few minutes on a 2-core CPU machine."""

    out: Path = Path("galva-run")
    nproc: int | None = None  # None: the local GPUs, or 4 CPU ranks without any
    num_layers: int = 8
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    ffn_hidden_size: int = 352
    seq_length: int = 128
    vocab_size: int = 512
    documents: int = 2000
    memory: str | None = None  # per device, the measured base memory included; None: CPU_MEMORY on CPU ranks, the
    # device's own memory on GPUs (a 1.3 GB demonstration budget does not hold one GPU's CUDA context and a model)
    context_memory: str | None = None  # None: the measured base (calibration, else hardware profile)
    calibration: Path | None = None  # a calibration from an earlier run's check stage, for the search
    global_batch_size: int = 16
    train_iters: int = 40
    lr: float = 3e-3
    prompt: str = "The old farmer"
    max_new_tokens: int = 16
    force: bool = False
    timing_span_s: float | None = None  # the profiles' --timing-span; None: theirs (5 s); --quick: 1 s


@dataclass
class StageResult:
    name: str
    seconds: float
    command: str
    artefacts: dict[str, str] = field(default_factory=dict)
    note: str = ""


def detect_devices() -> tuple[int, str]:
    """``(number of local GPUs, "gpu")`` or ``(0, "cpu")``."""
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - galva depends on torch through its stages
        count = 0
    return (count, "gpu") if count > 0 else (0, "cpu")


def _span_flags(o: PipelineOptions) -> list[str]:
    """The profiles' ``--timing-span`` when the run sets one (``--quick``, CI's variant, spends 1 s a measurement,
    not 5: its numbers are a smoke test's)."""
    return [] if o.timing_span_s is None else ["--timing-span", f"{o.timing_span_s:g}"]


def _memory_flags(memory: str | None, kind: str) -> list[str]:
    """galva-search's budget flag: the one given, else CPU_MEMORY on CPU ranks, else none (the device's memory)."""
    if memory is None and kind == "gpu":
        return []
    return ["--memory", memory or CPU_MEMORY]


def _python_command(*args: str) -> list[str]:
    """``python -m module args``: the same interpreter and environment as this process, whatever PATH holds."""
    return [sys.executable, "-m", *args]


def _display(cmd: Sequence[str]) -> str:
    """The command as a user would type it: entry points by name, not ``python -m``."""
    names = {
        "galva.cli": "galva",
        "galva_models.cli.data": "galva-data",
        "galva_profiler.cli": "galva-profile",
        "galva_search.cli": "galva-search",
        "galva_ckpt.cli": "galva-ckpt",
        "galva_models.report": "galva-report",
        "torch.distributed.run": "torchrun",
    }
    words = list(cmd)
    if words[:2] == [sys.executable, "-m"]:
        words = [names.get(words[2], f"python -m {words[2]}"), *words[3:]]
    return " ".join(w if w.startswith(("python -m ", "galva", "torchrun")) else shlex.quote(w) for w in words)


class _StageWatch:
    """While a stage runs, its own progress on the console: the last line of its log (a step line, a profiling step,
    a progress line), redrawn in place on a terminal, else one indented line every ``interval_s`` seconds (lines
    that are not stage lines: those start with ``[``)."""

    interval_s = 10.0
    redraw_s = 0.5

    def __init__(self, log: Path, head: str, stream: TextIO) -> None:
        self.log, self.head, self.stream = log, head, stream
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="galva-run-stage-watch", daemon=True)
        self._start = time.perf_counter()

    def __enter__(self) -> _StageWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.stream.write("\r\033[K")  # the stage line takes its place
            self.stream.flush()

    def _watch(self) -> None:
        period = self.redraw_s if self.tty else self.interval_s
        while not self._stop.wait(period):
            last = _last_line(self.log)
            elapsed = time.perf_counter() - self._start
            if self.tty:
                width = shutil.get_terminal_size().columns - 1
                self.stream.write(f"\r{self.head} {elapsed:7.1f} s  {last}"[:width] + "\033[K")
            else:
                self.stream.write(f"    {self.head.split('] ', 1)[-1].strip()} {elapsed:.0f} s: {last}\n")
            self.stream.flush()


def _last_line(log: Path) -> str:
    """The last non-empty line of ``log`` (a progress bar's frames split on carriage returns), from its tail."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [part.strip() for part in tail.replace("\r", "\n").split("\n") if part.strip()]
    return lines[-1] if lines and not lines[-1].startswith("$ ") else "started"  # the log's first line: the command


class _Runner:
    def __init__(self, out: Path, total: int, stream: TextIO) -> None:
        self.out, self.total, self.stream = out, total, stream
        self.results: list[StageResult] = []
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.out))
        except ValueError:
            return str(path)

    def stage(self, name: str, cmd: Sequence[str] | None, artefacts: dict[str, Path],
              work: Callable[[], str] | None = None, env: dict[str, str] | None = None) -> StageResult:
        """Run ``cmd`` (logged to logs/NAME.log, ``env`` added to the environment) and/or ``work`` (returns a note);
        print the stage line."""
        index = len(self.results) + 1
        log = self.out / "logs" / f"{name}.log"
        start = time.perf_counter()
        note = ""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if cmd is not None:
            with log.open("w", encoding="utf-8") as f:
                f.write("$ " + _display(cmd) + "\n")
                f.flush()
                # its own session: Ctrl-C reaches `galva run` only, which passes it on once and waits for the stage
                # to end the same way (its temporary files removed), see galva_schema.interrupt.wait_child
                proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=self.out,
                                        start_new_session=True)
                with _StageWatch(log, f"[{index:2d}/{self.total}] {name:<17}", self.stream):
                    code = wait_child(proc)
            if code != 0:
                self._fail(index, name, log, f"exit status {code}")
        if work is not None:
            try:
                note = work()
            except Exception as err:  # a stage's own failure: one line, then the log
                with log.open("a", encoding="utf-8") as f:
                    f.write(f"{type(err).__name__}: {err}\n")
                self._fail(index, name, log, f"{type(err).__name__}: {err}".splitlines()[0])
        seconds = time.perf_counter() - start
        missing = [str(p) for p in artefacts.values() if not p.exists()]
        if missing:
            self._fail(index, name, log, f"did not write {', '.join(missing)}")
        result = StageResult(name, seconds, _display(cmd) if cmd else "(in-process)",
                             {k: self.rel(v) for k, v in artefacts.items()}, note)
        self.results.append(result)
        shown = ", ".join(result.artefacts.values())
        extra = f" — {note}" if note else ""
        print(f"[{index:2d}/{self.total}] {name:<17} {seconds:7.1f} s  {shown}{extra}", file=self.stream, flush=True)
        return result

    def _fail(self, index: int, name: str, log: Path, why: str) -> None:
        print(f"[{index:2d}/{self.total}] {name:<17}  FAILED ({why}); last lines of {log}:", file=self.stream)
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.exists() else []
        for line in lines[-25:]:
            print(f"    {line}", file=self.stream)
        raise SystemExit(1)


def _max_tp(nproc: int) -> int:
    """galva-profile's --max-tp for ``nproc`` ranks: the largest power of two it measures that fits them."""
    return min(1 << (nproc.bit_length() - 1), 128)


def _profiled_batches(global_batch_size: int, nproc: int) -> str:
    """galva-profile's --batch-sizes: powers of two up to a rank's share of the global batch when half the ranks
    split it (a 2-stage pipeline's, one micro-batch; at least 1 and 2), that share too: the layer time such a plan
    runs at is measured, not extrapolated from smaller batches. A line through batch 1 and 2 read 0.44 + 1.97 ms per
    sample in one run and 1.80 + 1.01 in the next, for batch 4; the quickstart's pp-2 plan runs batch 8, and a line
    through 1, 2 and 4 put its forward at 11.3 ms in one profile and 12.6 in another of the same minutes."""
    top = max(2, global_batch_size // max(1, nproc // 2))
    sizes = {1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}
    return ",".join(str(b) for b in sorted(sizes))


def _search_note(strategy_path: Path, summary_path: Path) -> str:
    """The plan as galva-search summarised it (a :class:`galva_schema.SearchSummary`, checked against the strategy
    it was written with): the plan's one phrase (:meth:`Strategy.describe`), layer plans with their counts, predicted
    throughput."""
    from galva_schema import SearchSummary, Strategy

    summary = SearchSummary.load(summary_path)
    plan = Strategy.load(strategy_path)
    mismatch = summary.mismatch(plan)
    if mismatch is not None:
        raise ValueError(f"{summary_path}: {mismatch} in {strategy_path}: the summary of another plan")
    runs: list[tuple[str, int]] = []  # (plan label, layers) over the whole model, stages joined
    for run in summary.layer_runs:
        count = run.last - run.first + 1
        if runs and runs[-1][0] == run.strategy:
            runs[-1] = (run.strategy, runs[-1][1] + count)
        else:
            runs.append((run.strategy, count))
    layers = ", ".join(f"{label} x{count}" for label, count in runs)
    return f"{plan.describe()}; layers {layers}; predicted {summary.throughput_samples_per_s:.2f} samples/s"


def _metrics_note(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    return f"{len(records)} steps, loss {losses[0]:.3f} → {losses[-1]:.3f}" if losses else f"{len(records)} steps"


def run_pipeline(o: PipelineOptions, stream: TextIO = sys.stdout) -> list[StageResult]:
    """Run every stage into ``o.out``; returns the stage results (also written to ``o.out/run.json``).

    Raises ``ValueError`` (one line, before any stage) for an ``--out`` that cannot be written or is not empty
    without ``force``; a failed stage prints its line and log tail and raises ``SystemExit(1)``."""
    out = o.out.resolve()
    problem = output_problem(out, directory=True)  # a full disk fails here, not stages later (an earlier run kept)
    if problem is not None:
        raise ValueError(f"--out {out}: {problem}")
    if out.exists() and any(out.iterdir()) and not o.force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace it or --out elsewhere")
    # read before the directory is replaced: an earlier run's calibration.json may live inside it
    earlier = _load_calibration(o.calibration) if o.calibration is not None else None
    if out.exists() and any(out.iterdir()):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    gpus, kind = detect_devices()
    nproc = o.nproc or (gpus if gpus else 4)
    precision = "bf16" if kind == "gpu" else "fp32"
    print(f"galva run: {nproc} {'GPU' if kind == 'gpu' else 'CPU'} rank(s) ({'nccl' if kind == 'gpu' else 'gloo'}, "
          f"{precision}), output in {out}", file=stream, flush=True)
    started = time.perf_counter()
    r = _Runner(out, 12, stream)
    data, prof = out / "data", out / "profiles"
    data.mkdir(exist_ok=True)
    prof.mkdir(exist_ok=True)
    used_calibration = None
    if earlier is not None:
        used_calibration = earlier.save(prof / "calibration-used.json")
    corpus, tokenizer, model_dir = data / "corpus.jsonl", out / "tokenizer", out / "model"
    prefix = data / "corpus"
    hw, model_profile = prof / "hardware.json", prof / "model.json"
    strategy, summary = out / "strategy.json", out / "summary.json"
    metrics, ckpt, export, report = out / "metrics.jsonl", out / "checkpoints", out / "hf-export", out / "report.html"

    r.stage("corpus", _python_command("galva.cli", "corpus", "-o", str(corpus), "--documents", str(o.documents)),
            {"corpus": corpus})
    r.stage("tokenizer", _python_command("galva.cli", "tokenizer", str(corpus), "-o", str(tokenizer),
                                         "--vocab-size", str(o.vocab_size)), {"tokenizer": tokenizer})
    r.stage("preprocess", _python_command("galva_models.cli.data", "preprocess", "--input", str(corpus),
                                          "--tokenizer", str(tokenizer), "--output-prefix", str(prefix),
                                          "--append-eod", "--quiet"),
            {"tokens": prefix.with_suffix(".bin"), "index": prefix.with_suffix(".idx")})
    r.stage("model-config", _python_command(
        "galva.cli", "model-config", "-o", str(model_dir), "--tokenizer", str(tokenizer),
        "--num-layers", str(o.num_layers), "--hidden-size", str(o.hidden_size),
        "--num-attention-heads", str(o.num_attention_heads), "--num-key-value-heads", str(o.num_key_value_heads),
        "--ffn-hidden-size", str(o.ffn_hidden_size), "--vocab-size", str(o.vocab_size),
        "--seq-length", str(o.seq_length)), {"model config": model_dir / "config.json"})
    # on CPU both profiles compute with one training rank's threads (the launcher's default: cores / ranks, unless
    # OMP_NUM_THREADS is set): the model profile's layer times are a rank's, the compute slowdown only the sharing
    own = kind == "gpu" or "OMP_NUM_THREADS" in os.environ
    threads = {} if own else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    r.stage("profile-hardware", _python_command(
        "galva_profiler.cli", "hardware", "--nproc-per-node", str(nproc), "--quick", *_span_flags(o), "-o", str(hw),
        "--report", str(prof / "hardware-report.json")), {"hardware profile": hw}, env=threads)
    r.stage("profile-model", _python_command(
        "galva_profiler.cli", "model", "--model-config", str(model_dir), "--seq-lengths", str(o.seq_length),
        "--max-tp", str(_max_tp(nproc)), "--precision", precision, "--quick", *_span_flags(o),
        "--batch-sizes", _profiled_batches(o.global_batch_size, nproc), "-o", str(model_profile),
        "--report", str(prof / "model-report.json")), {"model profile": model_profile}, env=threads)
    r.stage("search", _python_command(
        "galva_search.cli", "--hardware-profile", str(hw), "--model-profile", str(model_profile),
        *_memory_flags(o.memory, kind),
        *(["--context-memory", o.context_memory] if o.context_memory else []),
        *(["--calibration", str(used_calibration)] if used_calibration else []),
        "--global-batch-size", str(o.global_batch_size), "--sp-space", "tp+sp",
        "--mixed-precision", precision, "--output", str(strategy), "--summary-json", str(summary),
        "--galvatron-output", str(out / "galvatron_config.json"), "--quiet"),
        {"strategy": strategy, "summary": summary}, work=lambda: _search_note(strategy, summary))
    r.stage("train", [*_python_command("galva_models.cli.train", "--nproc-per-node", str(nproc)),
                      "--model-config", str(model_dir),
                      "--strategy", str(strategy), "--seq-length", str(o.seq_length), "--data-path", str(prefix),
                      "--train-iters", str(o.train_iters), "--lr", str(o.lr), "--lr-warmup-iters", "5",
                      "--save", str(ckpt), "--metrics-jsonl", str(metrics), "--log-interval", "10"],
            {"metrics": metrics, "checkpoint": ckpt}, work=lambda: _metrics_note(metrics))
    saved = ckpt / f"step-{o.train_iters:08d}"
    r.stage("export", _python_command("galva_ckpt.cli", "g2h", str(saved), str(export), "--no-progress"),
            {"hf export": export}, work=lambda: _exported_tokenizer(export))
    generation = out / "generation.json"
    r.stage("generate", _python_command("galva.cli", "generate", str(export), "--prompt", o.prompt,
                                        "--max-new-tokens", str(o.max_new_tokens), "--json", str(generation)),
            {"generation": generation}, work=lambda: repr(json.loads(generation.read_text())["text"]))
    checked, calibration = out / "check.json", out / "calibration.json"
    r.stage("check", _python_command("galva.cli", "check", "--metrics", str(metrics), "--strategy", str(strategy),
                                     "--summary", str(summary), "-o", str(checked), "--calibration-output",
                                     str(calibration),
                                     *(["--calibration", str(used_calibration)] if used_calibration else [])),
            {"check": checked}, work=lambda: _check_note(checked))
    r.stage("report", _python_command("galva_models.report", str(metrics), "--strategy", str(strategy),
                                      "--summary", str(summary), "--check", str(checked), "-o", str(report)),
            {"report": report})
    total = time.perf_counter() - started
    artefacts = {k: str(out / v) for res in r.results for k, v in res.artefacts.items()}
    artefacts["checkpoint"] = str(saved)
    artefacts["logs"] = str(out / "logs")
    run = {"kind": "galva.run", "devices": {"kind": kind, "ranks": nproc, "precision": precision},
           "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(o).items()},
           "total_s": total, "stages": [asdict(res) for res in r.results], "artefacts": artefacts}
    write_text_atomic(out / "run.json", json.dumps(run, indent=2) + "\n")
    print(f"\ngalva run: done in {total:.1f} s. Artefacts:", file=stream)
    width = max(len(k) for k in artefacts)
    for key, path in artefacts.items():
        print(f"  {key:<{width}}  {path}", file=stream)
    print(f"  {'run summary':<{width}}  {out / 'run.json'}", file=stream)
    print("Stage times: " + ", ".join(f"{res.name} {res.seconds:.1f} s" for res in r.results), file=stream,
          flush=True)
    return r.results


def _load_calibration(path: Path) -> Any:
    """An earlier check's calibration, validated before anything runs (one line naming the file otherwise)."""
    from galva_schema import Calibration, SchemaError

    try:
        return Calibration.load(path)
    except (SchemaError, OSError) as err:
        raise ValueError(f"--calibration {path}: {str(err).splitlines()[0]}") from None


def _check_note(path: Path) -> str:
    """The check's line, and what to do with a calibration it wrote."""
    from galva.check import describe
    from galva_schema import RunCheck

    got = RunCheck.load(path)
    if got.calibration is None:
        return describe(got)
    return f"{describe(got)}; the next search: galva run --calibration {got.calibration}"


def _exported_tokenizer(export: Path) -> str:
    """The export holds what galva-train saved: config, weights and the tokenizer of its --model-config directory."""
    if not (export / "config.json").is_file():
        raise ValueError(f"{export}: g2h wrote no config.json")
    if not (export / "tokenizer.json").is_file():
        raise ValueError(f"{export}: g2h wrote no tokenizer.json (the checkpoint holds no tokenizer)")
    return "with the run's tokenizer"


def options_from_args(args: Any) -> PipelineOptions:
    """The argparse namespace of ``galva run`` as options (``--quick``: the CI variant, a few steps)."""
    kw = {k: getattr(args, k) for k in PipelineOptions.__dataclass_fields__ if getattr(args, k, None) is not None}
    kw["out"] = Path(kw.get("out", "galva-run"))
    if kw.get("calibration") is not None:
        kw["calibration"] = Path(kw["calibration"])
    if getattr(args, "quick", False):
        kw.setdefault("train_iters", 8)
        kw.setdefault("documents", 400)
        kw.setdefault("num_layers", 4)
        kw.setdefault("max_new_tokens", 4)
        kw.setdefault("timing_span_s", 1.0)
    return PipelineOptions(**kw)
