"""Per-layer-type cost tables of one (pipeline degree, micro-batch, accumulating) over the candidates, and their
Lagrangian duals (what the task bounds and the stage DPs read)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from galva_search.cost_model import CostModel, LayerTerms
from galva_search.rules import ModelRules
from galva_search.space import Candidate

LAMBDAS = np.concatenate([[0.0], np.logspace(-10, -2, 49)])
"""Multipliers (seconds per MiB) of the Lagrangian lower bound: any value gives a valid bound, more a tighter one."""


@dataclass
class CostTables:
    """Layer terms of every layer type for one (pp, micro-batch, accumulating), over the candidates ``candidates``."""

    candidates: list[Candidate]
    terms: list[LayerTerms]  # per layer type
    redistribution: list[np.ndarray]  # per layer type (of the receiving layer): [from][to] seconds per micro-batch
    penalty: list[np.ndarray]  # per layer type: [from][to] tie-breaker seconds
    fastest: list[int]  # per layer type: allowed candidate of least micro-batch time
    allowed: list[np.ndarray]  # per layer type: candidates the model can run (ModelRules.allowed)
    allowed_at_end: list[np.ndarray]  # the same for the last layer of the type (its output sequence too)
    dual_cache: dict[tuple[int, float], tuple[np.ndarray, float]] = field(default_factory=dict)  # see dual()

    def min_p2p(self, t: int) -> float:
        """The cheapest p2p send of a layer of type ``t`` over every candidate (a lower bound on any plan's)."""
        key = (t, -1.0)
        hit = self.dual_cache.get(key)
        if hit is None:
            p2p = self.terms[t].p2p_s
            hit = self.dual_cache[key] = (p2p, float(p2p.min()) if len(p2p) else 0.0)
        return hit[1]

    def dual(self, t: int, in_flight: float) -> tuple[np.ndarray, float]:
        """``g(lam) = min_s (U(s) + lam * M(s))`` over :data:`LAMBDAS`, and ``min_s M(s)``, for one layer of type
        ``t`` holding ``in_flight`` micro-batches (U: seconds per micro-batch, M: MiB)."""
        key = (t, in_flight)
        hit = self.dual_cache.get(key)
        if hit is None:
            terms, allowed = self.terms[t], self.allowed[t]
            mem = terms.memory_mib(in_flight)
            # refused candidates never enter a plan (their memory may be unknown: +inf, and 0 * inf is nan)
            with np.errstate(invalid="ignore"):
                priced = terms.micro_batch_s[None, :] + LAMBDAS[:, None] * mem[None, :]
            g = np.where(allowed[None, :], priced, np.inf).min(axis=1)
            hit = (g, float(mem[allowed].min()) if allowed.any() else math.inf)
            self.dual_cache[key] = hit
        return hit


def build_tables(
    cost: CostModel,
    candidates: Sequence[Candidate],
    micro_batch: int,
    accumulating: bool,
    rules: ModelRules | None = None,
) -> CostTables:
    """Cost tables of every layer type of ``cost.model`` for a global micro-batch of ``micro_batch`` samples;
    ``rules`` says which candidates each layer type may run (all of them when None)."""
    pool = list(candidates)
    c = 2 if accumulating else 1  # only "more than one micro-batch" matters for the terms themselves
    terms, redis, penalty, fastest, allowed, allowed_at_end = [], [], [], [], [], []
    for t in range(len(cost.model.layer_types)):
        lt = cost.layer_terms(t, pool, micro_batch, c)
        terms.append(lt)
        redis.append(cost.redistribution(t, pool, micro_batch))
        penalty.append(cost.switch_penalties(t, pool))
        mask = rules.allowed(t, pool, False) if rules else np.ones(len(pool), dtype=bool)
        allowed.append(mask)
        allowed_at_end.append(rules.allowed(t, pool, True) if rules else mask)
        fastest.append(int(np.argmin(np.where(mask, lt.micro_batch_s, np.inf))))
    return CostTables(pool, terms, redis, penalty, fastest, allowed, allowed_at_end)
