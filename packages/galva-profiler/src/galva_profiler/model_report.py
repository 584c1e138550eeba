"""The model sweep's report: every time with its fits and residuals, the backward/forward ratios, every activation
measurement (``galva-profile model --report``), beside the profiles :mod:`galva_profiler.model_profile` writes."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from galva_profiler.layer_timing import PassTimes
from galva_profiler.model_profile import ModelSweep


def sweep_report(sweep: ModelSweep) -> dict[str, Any]:
    """JSON-ready: every time with its fits and residuals, backward/forward ratios, every activation measurement."""
    layers = []
    for m in sweep.layers:
        per_seq = {}
        for seq, times in m.times.items():
            fwd, bwd = sweep.batch_fit(times), sweep.batch_fit(times, backward=True)
            per_seq[seq] = {
                "forward_ms": {b: t.forward_ms for b, t in times.items()},
                "backward_ms": {b: t.backward_ms for b, t in times.items()},
                "forward_batch_fit": fwd.to_dict(),
                "backward_batch_fit": bwd.to_dict(),
                "backward_over_forward": _ratio(times),
                "activations": m.activations[seq].to_dict(),
                "experts": m.experts[seq].model_dump(mode="json") if seq in m.experts else None,
            }
        seq_fit = sweep.sequence_fit(m.times)
        layers.append(
            {
                "name": m.name,
                "num_layers": m.num_layers,
                "built_layer_index": m.first_index,
                "parameter_bytes": m.parameter_bytes,
                "optimizer_step": asdict(m.step) if m.step else None,
                "by_seq_length": per_seq,
                "sequence_fit": seq_fit.to_dict() if seq_fit else None,
            }
        )
    return {
        "model": sweep.model.name,
        "built_modules": list(sweep.model.built),
        "device": sweep.options.device,
        "degrees": sweep.degrees,
        "vocab_degrees": sweep.vocab_degrees,
        "layers": layers,
        "vocab": {seq: v.to_dict() for seq, v in sweep.vocab.items()},
        "vocab_optimizer_step": asdict(sweep.vocab_step) if sweep.vocab_step else None,
    }


def _ratio(times: dict[int, PassTimes]) -> float:
    largest = max(times)
    return times[largest].backward_ms / max(times[largest].forward_ms, 1e-9)
