"""``galva-train``: train a Hugging Face model under a Galva plan, one process per GPU/CPU rank: started by
``--nproc-per-node N`` on one machine (the flags are checked once, a failure ends with one line), or by torchrun.

    galva-train --nproc-per-node 4 --model tiny-llama --pp 2 --tp 2 --checkpoint ...
    torchrun --nproc_per_node 4 -m galva_models.cli.train --model tiny-llama --pp 2 --tp 2 --checkpoint \\
        --global-batch-size 8 --num-micro-batches 2 --seq-length 64 --train-iters 30 --data-path data/corpus \\
        --metrics-jsonl metrics.jsonl

The loop reads top to bottom: global batch (identical on every rank), forward and backward under the plan
(galva-hp), clip, step, log. Arguments are parsed and validated by :func:`galva_models.cli.config.parse_train_config`
before any process group exists.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from galva_models.cli.config import ConfigError, TrainConfig, parse_train_config
from galva_schema.stderr import quiet_transformers


def make_source(cfg: TrainConfig) -> Any:
    """The global-batch source for the run's task: indexed data with --data-path, else seeded random data."""
    from galva_models.data import IndexedTokenSource, random_source

    if cfg.data_path is not None:
        return IndexedTokenSource(cfg.data_path, cfg.seq_length, cfg.global_batch_size, cfg.seed)
    c, gbs = cfg.model_config, cfg.global_batch_size
    return random_source(cfg.task.value, c, cfg.seq_length, gbs, cfg.seed, cfg.decoder_seq_length)


def _init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """The world group, with the start-up allowance of ``--collective-timeout`` (galva-comm gives every later group
    the same; :meth:`Watchdog.arm` sets them all to ``--collective-timeout`` before the first step)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from galva_comm.launch import init_single_rank_group, running_under_launcher
    from galva_hp.watchdog import startup_timeout

    timeout_s = startup_timeout(timeout_s)

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if running_under_launcher():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:  # run plainly: the one rank the world size defaults to
            init_single_rank_group(backend, timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def banner(cfg: TrainConfig, world: int) -> str:
    """The start-of-run line: model, ranks and the plan actually used (with what a flag changed in a plan file)."""
    line = f"galva-train: {cfg.model_name} on {world} rank{'s' if world > 1 else ''}: {cfg.strategy.describe()}"
    line += f" (plan from {cfg.plan_source}"
    line += "; " + "; ".join(cfg.plan_overrides) + ")" if cfg.plan_overrides else ")"
    return line


def build_model(cfg: TrainConfig) -> Any:
    """The Hugging Face model (from a checkpoint or freshly initialised with the run's seed) and its LayeredModel."""
    import torch

    from galva_models.attention import attn_implementation

    impl = attn_implementation(cfg.attention_backend)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if cfg.hf_checkpoint is not None:
        from transformers import AutoModel

        auto = {
            "causal_lm": "AutoModelForCausalLM",
            "masked_lm": "AutoModelForMaskedLM",
            "seq2seq_lm": "AutoModelForSeq2SeqLM",
            "image_classification": "AutoModelForImageClassification",
        }[cfg.task.value]
        import transformers

        cls = getattr(transformers, auto, AutoModel)
        model = cls.from_pretrained(
            cfg.hf_checkpoint, config=cfg.model_config, local_files_only=True, attn_implementation=impl
        ).train()  # the config galva-train validated (same directory); train mode: from_pretrained gives eval mode
    elif cfg.initialize_on_meta:
        with torch.device("meta"):
            model = cfg.adapter.build_model(cfg.model_config, attn_implementation=impl)
    else:
        model = cfg.adapter.build_model(cfg.model_config, attn_implementation=impl)
    return model, cfg.adapter.decompose(model, **_decompose_options(cfg))


def _decompose_options(cfg: TrainConfig) -> dict[str, Any]:
    from galva_models.tables.family import length_options

    return length_options(cfg.task, cfg.seq_length, cfg.decoder_seq_length)


def checkpoint_io(cfg: TrainConfig, model: Any, optimizer: Any) -> Any:
    """Save/load for the built model: the same model decomposed again on the meta device finds every shard's
    place (:mod:`galva_models.checkpointing`)."""
    import json
    from pathlib import Path

    import torch

    from galva_ckpt.hf import read_side_files
    from galva_models.checkpoint_names import checkpoint_names
    from galva_models.checkpointing import CheckpointIO

    with torch.device("meta"):
        fresh = cfg.adapter.build_model(cfg.model_config, attn_implementation="sdpa")
    layered = cfg.adapter.decompose(fresh, **_decompose_options(cfg))
    config = json.loads(cfg.model_config.to_json_string(use_diff=False))
    side_files = read_side_files(Path(cfg.model_dir)) if cfg.model_dir else {}  # its tokenizer; --load adds its own
    return CheckpointIO(model, optimizer, checkpoint_names(cfg.model_config), layered, config, side_files)


def run(cfg: TrainConfig) -> int:
    """Train for ``cfg.train_iters`` steps (every rank calls this). Returns the process exit code.

    A watchdog runs beside the loop (:mod:`galva_hp.watchdog`): a rank that stops making progress for
    ``--collective-timeout`` seconds ends the job with one line naming it; Ctrl-C ends every rank with one line.
    """
    from galva_comm.launch import is_collective_error, running_under_launcher
    from galva_hp.watchdog import Watchdog

    if cfg.world_size > 1 and not running_under_launcher():
        n = cfg.world_size
        print(
            f"galva-train: error: a world of {n} ranks needs {n} processes: add --nproc-per-node {n}, or start "
            "galva-train with torchrun",
            file=sys.stderr,
        )
        return 2
    rank, world = _init_distributed(cfg.collective_timeout_s)
    watchdog = Watchdog(rank=rank, world_size=world, timeout_s=cfg.collective_timeout_s, prog="galva-train").start()
    from galva_models.tables.errors import UnsupportedModel

    try:
        return _run(cfg, rank, world, watchdog)
    except UnsupportedModel as err:  # every rank finds it in the same place: one of them says it
        if rank == 0:
            print(f"galva-train: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if world > 1 and is_collective_error(err):
            return watchdog.fail(err)  # one line naming the stuck rank (or the one that raised); exits
        if world > 1:
            return watchdog.crash(err)  # this rank raised: its traceback, one line naming it; exits
        raise
    finally:
        watchdog.stop()


def _run(cfg: TrainConfig, rank: int, world: int, watchdog: Any) -> int:
    import torch
    import torch.distributed as dist

    from galva_hp import BuildOptions, GalvaOptimizer, OptimConfig, build, train_step
    from galva_hp.hooks import base_memory_mib, peak_above_base_mib
    from galva_models.metrics import MetricsLogger, train_flops_per_token
    from galva_models.tables.family import hf_init_fn

    if rank == 0:
        print(banner(cfg, world), file=sys.stderr, flush=True)
    base_mib = base_memory_mib()  # before the model: galva run's check stage compares the peak above it
    hf_model, layered = build_model(cfg)
    num_params = sum(p.numel() for p in hf_model.parameters())
    recompute = sum(layer.checkpoint for layer in cfg.strategy.layers) / cfg.strategy.num_layers
    flops_per_token = train_flops_per_token(num_params, cfg.layer_specs, recompute)
    init_fn = hf_init_fn(hf_model, cfg.seed) if cfg.initialize_on_meta else None
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    options = BuildOptions(seq_len=cfg.seq_length or None, init_fn=init_fn, device=device)
    model = build(layered, cfg.strategy, options)
    del hf_model
    o = cfg.optim
    min_lr_ratio = o.min_lr / o.lr if o.lr > 0 else 0.0
    optimizer = GalvaOptimizer(
        model.param_records(),
        OptimConfig(
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
            warmup_steps=o.warmup_iters,
            total_steps=cfg.train_iters,
            min_lr_ratio=min_lr_ratio,
            max_grad_norm=o.clip_grad,
            decay_style=o.decay_style,
        ),
    )
    io = checkpoint_io(cfg, model, optimizer) if cfg.checkpoint.save or cfg.checkpoint.load else None
    start_step = 0
    if cfg.checkpoint.load is not None:
        from galva_ckpt.errors import CheckpointError
        from galva_models.checkpointing import open_source

        assert io is not None
        try:
            start_step = io.load(open_source(cfg.checkpoint.load), weights_only=cfg.checkpoint.finetune)
        except CheckpointError as err:
            if rank == 0:
                print(f"galva-train: error: --load: {err}", file=sys.stderr)
            return 2
        if rank == 0 and start_step:
            print(f"galva-train: continuing from step {start_step} of {cfg.checkpoint.load}", file=sys.stderr)
    source = make_source(cfg)
    logger = None
    report_records: list[dict[str, Any]] | None = [] if rank == 0 and cfg.report_html else None
    if rank == 0:
        logger = MetricsLogger(
            total_steps=cfg.train_iters,
            jsonl_path=cfg.metrics_jsonl,
            tensorboard_dir=cfg.tensorboard_dir,
            progress=cfg.progress,
            log_interval=cfg.log_interval,
            resume_step=start_step or None,  # a resumed run appends to the earlier run's metrics
        )
    try:
        last = start_step  # steps done
        saved_at = start_step if cfg.checkpoint.load and not cfg.checkpoint.finetune else -1
        watchdog.arm()
        for step in range(start_step, cfg.train_iters):
            watchdog.step(step + 1)
            batch = source.batch(step)
            start = time.perf_counter()
            metrics = train_step(model, optimizer, batch.inputs, batch.labels)
            seconds = (metrics.step_ms / 1e3) if metrics.step_ms else time.perf_counter() - start
            tokens = _tokens(cfg, batch)
            if torch.cuda.is_available():
                # on a GPU, device memory outside the allocator grows with the first steps (kernels loaded on first
                # use, cuBLAS handles, the communicators' buffers): the base is what it holds after them, as the
                # hardware profile measures it after its warm-up step (before the model it read 527 of 1311 MiB)
                base_mib = max(base_mib, base_memory_mib())
            if logger is not None:
                record = {
                    "step": step + 1,  # from 1, as the console and the checkpoint names (step-00000001)
                    "loss": metrics.loss,
                    "lr": metrics.lr,
                    "grad_norm": metrics.grad_norm,
                    "step_time_s": seconds,
                    "tokens_per_s": tokens / seconds,
                    "samples_per_s": batch.size / seconds,
                    "tflops": flops_per_token * tokens / seconds / world / 1e12,
                    "peak_memory_mib": metrics.peak_memory_mib,
                    "base_memory_mib": base_mib,
                    "peak_above_base_mib": peak_above_base_mib(base_mib),
                }
                logger.log(record)
                if report_records is not None:
                    report_records.append(record)
            if not torch.isfinite(torch.tensor(metrics.loss)):
                print(f"galva-train: error: loss is {metrics.loss} at step {step + 1}", file=sys.stderr)
                return 1
            last = step + 1
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and last % cfg.checkpoint.save_interval == 0:
                if not _save(io, cfg, optimizer, last, rank):
                    return 1
                saved_at = last
            if cfg.checkpoint.exit_interval and last % cfg.checkpoint.exit_interval == 0:
                break
        if cfg.checkpoint.save and saved_at != last and not _save(io, cfg, optimizer, last, rank):
            return 1
    finally:
        if logger is not None:
            logger.close()
        if report_records:  # also after a diverged run: the charts show where it went wrong
            _write_report(str(cfg.report_html), cfg, report_records, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _tokens(cfg: TrainConfig, batch: Any) -> int:
    """Tokens of one global batch: token ids for text; for images, the patches entering the first layer per image
    (an image is not a token: the per-token FLOP estimate then counts every patch)."""
    if batch.inputs.dim() == 2:
        return int(batch.inputs.numel())
    return int(batch.size) * (cfg.layer_specs[0].seq_length if cfg.layer_specs else 1)


def _save(io: Any, cfg: TrainConfig, optimizer: Any, step: int, rank: int) -> bool:
    """Save step ``step`` (collective); False after a save that could not be written (every rank learns it
    together, rank 0 says it in one line: the run ends, its earlier saves intact and no temporary left)."""
    from galva_ckpt.errors import CheckpointError
    from galva_models.checkpointing import scheduler_state

    scheduler = {**scheduler_state(optimizer), "schedule": cfg.lr_schedule}  # a resume must repeat the schedule
    try:
        io.save(cfg.checkpoint.save, step, scheduler, keep_last=cfg.checkpoint.keep_last)
    except CheckpointError as err:
        if rank == 0:
            print(f"galva-train: error: {err}", file=sys.stderr)
        return False
    return True


def _write_report(path: str, cfg: TrainConfig, records: list[dict[str, Any]], world: int) -> None:
    """``--report-html``: the run's step metrics as one HTML page (atomic write); a failure only warns."""
    from galva_models.report import write_report

    s = cfg.strategy
    facts = {
        "model": cfg.model_name,
        "world size": world,
        "plan": s.describe(),
        "global batch size": s.global_batch_size,
        "sequence length": cfg.seq_length,
        "precision": s.mixed_precision.value,
        "train iters": cfg.train_iters,
        "data": cfg.data_path or "random",
        "metrics file": cfg.metrics_jsonl,
    }
    try:
        write_report(path, records, facts, f"Galva training report: {cfg.model_name}")
    except OSError as err:
        print(f"galva-train: warning: cannot write --report-html {path}: {err}", file=sys.stderr)


SAVE_LOCK_ENV = "GALVA_TRAIN_SAVE_LOCK"
"""Set by a process launching the ranks (``--nproc-per-node``) to the ``--save`` lock file it holds for them."""


def _own_save_dir(cfg: TrainConfig, launching: bool) -> Any:
    """Take ``--save`` for this run (:class:`galva_ckpt.saves.SaveDirLock`, held until the process ends): done by
    the process launching the ranks, else by global rank 0, before any process group exists. Returns the lock, or
    None where another process holds it for this run. Raises ``SaveDirBusy`` when another run owns the directory."""
    from galva_ckpt.saves import SaveDirLock

    if cfg.checkpoint.save is None:
        return None
    lock = SaveDirLock(cfg.checkpoint.save)
    held_for_us = os.environ.get(SAVE_LOCK_ENV) == str(lock.path.resolve())
    if not launching and (os.environ.get("RANK", "0") != "0" or held_for_us):
        return None
    try:
        lock.acquire()
    except OSError as err:  # a file system without locks: the run goes on, unprotected, and says so
        print(
            f"galva-train: warning: --save {cfg.checkpoint.save}: cannot lock it ({err.strerror or err}); "
            "a second run saving there would not be stopped",
            file=sys.stderr,
        )
        return None
    return lock


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``galva-train``; Ctrl-C or SIGTERM end it with one line from the whole job: before the first
    step :mod:`galva_schema.interrupt`, then the watchdog (:mod:`galva_hp.watchdog`)."""
    from galva_schema.interrupt import run_command

    return run_command("galva-train", lambda: _main(argv), end_process=argv is None)


def _main(argv: list[str] | None) -> int:
    quiet_transformers()
    try:
        cfg = parse_train_config(argv)
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same mistake: one of them says it
            print(f"galva-train: error: {err}", file=sys.stderr)
        return 2
    from galva_ckpt.saves import SaveDirBusy
    from galva_comm.launch import LaunchError, launch_local, running_under_launcher

    launching = bool(cfg.launch_ranks) and not running_under_launcher()
    try:
        lock = _own_save_dir(cfg, launching)
    except SaveDirBusy as err:  # two runs saving into one directory would overwrite each other's saves
        print(f"galva-train: error: --save {err}", file=sys.stderr)
        return 2
    try:
        if launching and cfg.launch_ranks:
            # checked once here; the ranks parse the same arguments again and run
            args = sys.argv[1:] if argv is None else list(argv)
            if lock is not None:
                os.environ[SAVE_LOCK_ENV] = str(lock.path.resolve())
            try:
                return launch_local(cfg.launch_ranks, "galva_models.cli.train", args, prog="galva-train")
            except LaunchError as err:
                print(f"galva-train: error: {err}", file=sys.stderr)
                return 1
            finally:
                os.environ.pop(SAVE_LOCK_ENV, None)
        return run(cfg)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
