"""Per-layer-type cost tables of one (pipeline degree, micro-batch, accumulating) over the candidates, and their
Lagrangian duals (what the task bounds and the stage DPs read)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from galva_search.cost_model import CostModel, LayerTerms, VocabOption
from galva_search.rules import ModelRules
from galva_search.space import Candidate
from galva_search.sync_buckets import bucket_share_s

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
    boundary_cache: dict[tuple[VocabOption, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    sync_cache: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # see sync_share()

    def sync_share(self, cost: CostModel, t: int, count: int) -> np.ndarray:
        """Per candidate, the exposed gradient sync of a layer of type ``t`` among ``count`` of its type in one model
        chunk (:func:`galva_search.sync_buckets.bucket_share_s`): what the stage DP's rows and the plan's score both
        add, kept per (type, count) (read-only)."""
        key = (t, count)
        hit = self.sync_cache.get(key)
        if hit is None:
            s = cost.settings
            hit = bucket_share_s(cost.comm, self.terms[t], count, s.bucket_cap_bytes, s.factors.dp_comm)
            self.sync_cache[key] = hit
        return hit

    def vocab_boundaries(
        self, cost: CostModel, option: VocabOption, micro_batch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``cost.vocab_boundaries`` over these candidates, kept per (vocabulary plan, micro-batch): the search asks
        it for every plan it scores (read-only arrays)."""
        key = (option, micro_batch)
        hit = self.boundary_cache.get(key)
        if hit is None:
            hit = self.boundary_cache[key] = cost.vocab_boundaries(option, self.candidates, micro_batch)
        return hit

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
    tables = CostTables(pool, terms, redis, penalty, fastest, allowed, allowed_at_end)
    keep = undominated_expert_layouts(tables)
    return tables if keep is None else _subset(tables, keep)


_DECIDING = (
    "micro_batch_s", "exposed_sync_s", "weight_grad_s", "states_mib", "activation_mib", "transient_mib", "step_s"
)
"""The layer terms a plan's time and memory are made of (the rest only split them into parts for reports)."""


_NOT_EXPERT = tuple(f.name for f in fields(Candidate) if f.name not in ("ep", "etp", "expert_dp_type"))


def undominated_expert_layouts(tables: CostTables) -> np.ndarray | None:
    """Which candidates to keep (None: all) when expert layouts are among them: of the candidates that differ only in
    their expert layout (the same attention layout, dp type and checkpointing, hence the same re-sharding, p2p and
    switch costs to every neighbour), one whose deciding terms are all at least another's for every layer type, and
    that no layer type may run where the other may not, can never make a plan better: it is dropped (of equal ones,
    the first is kept). Exact, and what keeps the expert layouts from multiplying the dynamic programme's work."""
    pool = tables.candidates
    if all(c.ep == 1 and c.etp == 1 and c.expert_dp_type is None for c in pool):
        return None
    columns = []
    for t, lt in enumerate(tables.terms):
        columns += [np.asarray(getattr(lt, name), dtype=float) for name in _DECIDING if len(getattr(lt, name))]
        columns += [(~tables.allowed[t]).astype(float), (~tables.allowed_at_end[t]).astype(float)]
    m = np.nan_to_num(np.stack(columns, axis=1), nan=np.inf)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(pool):  # the candidate less its expert layout (as replace(c, ep=1, ...) would compare)
        groups.setdefault(tuple(getattr(c, name) for name in _NOT_EXPERT), []).append(i)
    keep = np.ones(len(pool), dtype=bool)
    for members in groups.values():
        if len(members) < 2:
            continue
        rows = m[members]  # beats[a, b]: member a matches or beats member b everywhere (of equal ones, the first)
        beats = (rows[:, None, :] <= rows[None, :, :]).all(axis=2) & (
            (rows[:, None, :] < rows[None, :, :]).any(axis=2) | np.tri(len(members), k=-1, dtype=bool).T
        )
        for b, i in enumerate(members):  # in order: a member dropped before i no longer drops others
            if any(a != b and keep[j] and beats[a, b] for a, j in enumerate(members)):
                keep[i] = False
    return keep


def _subset(tables: CostTables, keep: np.ndarray) -> CostTables:
    index = np.flatnonzero(keep)
    terms = [
        type(lt)(**{f.name: (getattr(lt, f.name)[index] if len(getattr(lt, f.name)) else getattr(lt, f.name))
                    for f in fields(lt)})
        for lt in tables.terms
    ]
    allowed = [a[index] for a in tables.allowed]
    fastest = [int(np.argmin(np.where(a, lt.micro_batch_s, np.inf))) for a, lt in zip(allowed, terms)]
    return CostTables(
        [tables.candidates[i] for i in index], terms, [r[np.ix_(index, index)] for r in tables.redistribution],
        [p[np.ix_(index, index)] for p in tables.penalty], fastest, allowed, [a[index] for a in tables.allowed_at_end],
    )
