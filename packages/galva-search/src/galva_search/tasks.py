"""Tasks of the outer search and their lower bounds (docs/cost-model.md §9).

A *task* fixes the global batch size, the micro-batch count, the pipeline degree and schedule (with its model
chunks per stage), the partition of the layers into model chunks (one per stage unless interleaved) and the
vocabulary plan; the stage DPs then choose every layer's candidate. Before any DP runs, each task gets a lower bound
on its iteration time (weak Lagrangian duality per stage) and a memory test, so that the search can solve tasks
best-bound first and stop early.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from galva_comm.layout import ranks_per_stage
from galva_schema import DataParallelType, PipelineSchedule
from galva_search.cost_model import CostModel, SharedProcessors, VocabOption, VocabTerms
from galva_search.cost_tables import LAMBDAS, CostTables, build_tables
from galva_search.layer_sequence import LayerSequence
from galva_search.options import SearchOptions, TaskRecord
from galva_search.partition import balanced_division, even_division
from galva_search.rules import ModelRules
from galva_search.space import Candidate

__all__ = ["CostTables", "LayerSequence", "Task", "TaskEnumerator", "bound_time", "build_tables"]

_LABELS: dict[tuple[PipelineSchedule, int], str] = {}


@dataclass
class Task:
    """One combination of the outer search; ``bound_s`` is a lower bound on its iteration time (inf: cannot fit)."""

    batch_size: int
    micro_batches: int
    pp: int
    division: tuple[int, ...]
    vocab: VocabOption
    tables: CostTables
    vocab_terms: list[VocabTerms]  # per stage
    bound_s: float = 0.0
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per stage (interleaved-1f1b: >= 2); ``division`` has pp * this entries

    @property
    def micro_batch(self) -> int:
        """Samples of one global micro-batch."""
        return self.batch_size // self.micro_batches

    @property
    def schedule_label(self) -> str:
        """``1f1b``, ``zb-h1``, ``interleaved-1f1b:2`` (chunks per stage), ..."""
        key = (self.schedule, self.virtual_stages)
        hit = _LABELS.get(key)
        if hit is None:
            v = f":{self.virtual_stages}" if self.virtual_stages > 1 else ""
            hit = _LABELS[key] = f"{self.schedule.value}{v}"
        return hit

    def record(self, status: str) -> TaskRecord:
        """This task's line of the search log, with ``status``."""
        vocab = self.vocab.label()
        return TaskRecord(
            self.batch_size, self.micro_batches, self.pp, self.division, vocab, self.bound_s, status,
            schedule=self.schedule_label,
        )


class TaskEnumerator:
    """Every task of a search, with its bound; cost tables, vocabulary terms, partitions and bounds are built once
    per distinct key and shared between tasks."""

    def __init__(
        self, cost: CostModel, options: SearchOptions, by_pp: dict[int, list[Candidate]], rules: ModelRules
    ) -> None:
        self.cost = cost
        self.options = options
        self.by_pp = by_pp
        self.rules = rules
        self.layers = LayerSequence([lt.num_layers for lt in cost.model.layer_types])
        self.usable_mib = options.usable_mib
        self._tables: dict[tuple[int, int, bool], CostTables | None] = {}
        self._divisions: dict[tuple, list[tuple[int, ...]]] = {}
        self._vocab: dict[tuple, list[VocabTerms]] = {}
        self._vocab_base: dict[tuple, list[VocabTerms]] = {}
        self._bounds: dict[tuple, list[float] | None] = {}
        self._stage_bounds: dict[tuple, float] = {}
        self._sends: dict[tuple, list[float]] = {}
        self._time_divisions: dict[tuple, tuple[int, ...] | None] = {}
        self._in_flight: dict[tuple, tuple[float, ...]] = {}

    def tables(self, pp: int, micro_batch: int, accumulating: bool) -> CostTables | None:
        """Tables over the candidates of ``pp`` whose dp divides the micro-batch (None: no such candidate)."""
        key = (pp, micro_batch, accumulating)
        if key not in self._tables:
            allowed = [c for c in self.by_pp.get(pp, []) if micro_batch % c.dp == 0]
            self._tables[key] = (
                build_tables(self.cost, allowed, micro_batch, accumulating, self.rules) if allowed else None
            )
        return self._tables[key]

    def schedules(self, pp: int, c: int) -> list[tuple[PipelineSchedule, int]]:
        """The ``(schedule, model chunks per stage)`` pairs a task of ``pp`` stages and ``c`` micro-batches may run.

        One stage has no pipeline: the first non-interleaved schedule asked for (1F1B when only interleaved is).
        Interleaved 1F1B needs ``c`` a multiple of ``pp`` and at least one layer per chunk; zb-h1 with fewer
        micro-batches than stages is skipped when 1F1B is also searched (it cannot defer its weight gradients and
        holds more activations: never faster).
        """
        interleaved, zb, one = (
            PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.ZB_H1, PipelineSchedule.ONE_F_ONE_B
        )
        asked = self.options.schedules or (self.cost.settings.pipeline_schedule,)
        if pp == 1:
            return [(next((x for x in asked if x is not interleaved), one), 1)]
        out: list[tuple[PipelineSchedule, int]] = []
        for schedule in dict.fromkeys(asked):
            if schedule is interleaved:
                if c % pp == 0:
                    chunks = sorted({v for v in self.options.virtual_stages if v >= 2 and pp * v <= len(self.layers)})
                    out.extend((schedule, v) for v in chunks)
            elif schedule is zb and c < pp and one in asked:
                continue
            else:
                out.append((schedule, 1))
        return out

    def enumerate(self) -> list[Task]:
        """Every task, unsorted."""
        o = self.options
        space = o.space
        settings = self.cost.settings
        allow_sp = space.sp_space in ("tp+sp", "sp") and not space.disable_vtp
        allow_zero3 = not space.disable_sdp and settings.default_dp_type is not DataParallelType.ZERO3
        vocab_by_pp = {
            pp: [
                option
                for option in self.cost.vocab_options(
                    pp,
                    space.max_tp,
                    allow_sp=allow_sp,
                    allow_zero3=allow_zero3,
                    allow_tp=not space.disable_vtp,
                    max_cp=space.max_cp,
                )
                if self.rules.vocab_allows(option)
            ]
            for pp in self.by_pp
        }
        tasks: list[Task] = []
        for batch in o.batch_sizes:
            for c in [o.num_micro_batches] if o.num_micro_batches else _divisors(batch):
                if batch % c:
                    continue
                micro = batch // c
                for pp in sorted(self.by_pp):
                    tables = self.tables(pp, micro, c > 1) if pp <= len(self.layers) else None
                    if tables is None:
                        continue
                    schedules = self.schedules(pp, c)
                    for option in vocab_by_pp[pp]:
                        if micro % (ranks_per_stage(self.cost.world_size, pp) // (option.tp * option.cp)):  # its dp
                            continue
                        for schedule, v in schedules:
                            vt = self.vocab_terms(pp, option, micro, c, schedule, v)
                            for division in self._partitions(pp, tables, c, vt, schedule, v):
                                tasks.append(
                                    self.make_task(
                                        batch, c, pp, division, option, tables, vt,
                                        schedule=schedule, virtual_stages=v,
                                    )
                                )
        return tasks

    def in_flight(self, task: Task) -> tuple[float, ...]:
        """Micro-batches of activations each stage of ``task`` holds at its peak (``CostModel.in_flight``)."""
        return self._flight(task.pp, task.micro_batches, task.schedule, task.virtual_stages)

    def _flight(self, pp: int, c: int, schedule: PipelineSchedule | None, virtual_stages: int) -> tuple[float, ...]:
        key = (pp, c, schedule, virtual_stages)
        hit = self._in_flight.get(key)
        if hit is None:
            hit = self._in_flight[key] = tuple(self.cost.in_flight(pp, c, schedule, virtual_stages))
        return hit

    def vocab_terms(
        self,
        pp: int,
        option: VocabOption,
        micro: int,
        c: int,
        schedule: PipelineSchedule | None = None,
        virtual_stages: int = 1,
    ) -> list[VocabTerms]:
        in_flight = self._flight(pp, c, schedule, virtual_stages)
        key = (pp, option, micro, c > 1, in_flight[0], in_flight[-1])
        hit = self._vocab.get(key)
        if hit is None:
            # the terms without activations in flight, once per (pp, option, micro-batch, accumulating); each
            # in-flight count only changes the memory (states + n * activations of one micro-batch)
            base_key = (pp, option, micro, c > 1)
            base = self._vocab_base.get(base_key)
            if base is None:
                base = self._vocab_base[base_key] = self.cost.vocab_terms(pp, option, micro, c, [0] * pp)
            hit = [replace(vt, memory_mib=vt.states_mib + vt.activation_mib * n) for vt, n in zip(base, in_flight)]
            self._vocab[key] = hit
        return hit

    def _partitions(
        self,
        pp: int,
        tables: CostTables,
        c: int,
        vocab: list[VocabTerms],
        schedule: PipelineSchedule | None = None,
        virtual_stages: int = 1,
    ) -> list[tuple[int, ...]]:
        """The even, memory-balanced and time-balanced partitions into ``pp * virtual_stages`` model chunks (those
        asked for), without repeats. Chunk ``k`` runs on stage ``k % pp``: its layers are weighed with that stage's
        in-flight count, the vocabulary layers load the first and the last chunk."""
        L = len(self.layers)
        if pp == 1:
            return [(L,)]
        n = pp * virtual_stages
        in_flight = self._flight(pp, c, schedule, virtual_stages)
        # only the first and the last stage hold vocabulary layers
        key = (
            pp,
            n,
            id(tables),
            in_flight,
            round(vocab[0].memory_mib),
            round(vocab[-1].memory_mib),
            round(vocab[0].micro_batch_s, 6),
            round(vocab[-1].micro_batch_s, 6),
        )
        hit = self._divisions.get(key)
        if hit is not None:
            return hit
        wanted = self.options.partitions
        chunk_flight = [in_flight[k % pp] for k in range(n)]

        def extra(values: list[float]) -> list[float]:  # the vocabulary's load on the first and the last chunk
            out = [0.0] * n
            out[0] += values[0]
            out[-1] += values[-1]
            return out

        out: list[tuple[int, ...]] = []
        if "even" in wanted:
            out.append(tuple(even_division(L, n)))
        if "memory" in wanted:
            runs = []
            for t, count in self.layers.runs:
                terms, f = tables.terms[t], tables.fastest[t]
                runs.append(
                    (count, [float(terms.states_mib[f] + m * terms.activation_mib[f]) for m in chunk_flight])
                )
            got = balanced_division(runs, extra([v.memory_mib for v in vocab]))
            if got:
                out.append(tuple(got))
        if "time" in wanted:
            time_key = (n, id(tables), tuple(round(v.micro_batch_s, 6) for v in vocab))
            if time_key not in self._time_divisions:
                runs = [
                    (count, [float(tables.terms[t].micro_batch_s[tables.fastest[t]])] * n)
                    for t, count in self.layers.runs
                ]
                got = balanced_division(runs, extra([v.micro_batch_s for v in vocab]))
                self._time_divisions[time_key] = tuple(got) if got else None
            timed = self._time_divisions[time_key]
            if timed:
                out.append(timed)
        out = list(dict.fromkeys(d for d in out if len(d) == n and min(d) > 0))
        self._divisions[key] = out
        return out

    def stage_budgets(self, task: Task) -> list[float]:
        """MiB per stage left to the layers: usable memory less the vocabulary layers and the framework context.
        (The transients a plan holds while one of its layers runs are set aside per plan by the stage solver.)"""
        context = self.cost.settings.context_mib
        return [self.usable_mib - task.vocab_terms[s].memory_mib - context for s in range(task.pp)]

    def make_task(
        self,
        batch: int,
        c: int,
        pp: int,
        division: tuple[int, ...],
        option: VocabOption,
        tables: CostTables,
        vt: list[VocabTerms],
        *,
        schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
        virtual_stages: int = 1,
    ) -> Task:
        """A task with its lower bound on the iteration time (inf when some stage cannot fit at all).

        Per stage, weak Lagrangian duality bounds the per-micro-batch time of any plan that fits the stage budget B:
        ``U >= max_lam sum_l min_s (U_ls + lam * M_ls) - lam * B`` (lam = 0 is the fastest-strategy bound);
        redistribution costs are >= 0 and left out; each p2p send of the stage (two per boundary between model
        chunks, :meth:`LayerSequence.stage_p2p_types`) costs at least the cheapest candidate's. The iteration time is
        monotone in every U_s
        (:func:`bound_time`). The stage bounds depend on the micro-batch count only through the in-flight counts,
        so they are shared between tasks.
        """
        task = Task(batch, c, pp, tuple(division), option, tables, vt, schedule=schedule, virtual_stages=virtual_stages)
        in_flight = self.in_flight(task)
        key = (id(tables), in_flight, option, task.division)
        if key in self._bounds:
            stage_u = self._bounds[key]
        else:
            stage_u = []
            sends_key = (id(tables), task.division, pp)
            sends = self._sends.get(sends_key)
            if sends is None:
                p2p_types = self.layers.stage_p2p_types(task.division, pp)
                sends = self._sends[sends_key] = [sum(tables.min_p2p(t) for t in types) for types in p2p_types]
            for s, (counts, budget) in enumerate(
                zip(self.layers.stage_type_counts(task.division, pp), self.stage_budgets(task))
            ):
                # one stage's bound depends only on its layers, in-flight count and budget: shared between tasks
                stage_key = (id(tables), tuple(counts), in_flight[s], budget)
                layer_u = self._stage_bounds.get(stage_key)
                if layer_u is None:
                    total = np.zeros(len(LAMBDAS))
                    min_mem = 0.0
                    for t, count in counts:
                        g, m = tables.dual(t, in_flight[s])
                        total += count * g
                        min_mem += count * m
                    layer_u = math.inf if min_mem > budget else float(np.max(total - LAMBDAS * budget))
                    self._stage_bounds[stage_key] = layer_u
                if layer_u == math.inf:
                    stage_u = None
                    break
                stage_u.append(vt[s].micro_batch_s + sends[s] + layer_u)
            self._bounds[key] = stage_u
        task.bound_s = (
            math.inf
            if stage_u is None
            else bound_time(
                stage_u,
                c,
                schedule,
                virtual_stages,
                self.cost.settings.backward_coefficient,
                self.cost.shared_processors(pp),
            )
        )
        return task


def bound_time(
    stage_u: Sequence[float],
    c: int,
    schedule: PipelineSchedule,
    virtual_stages: int,
    backward_coefficient: float,
    shared: SharedProcessors | None = None,
) -> float:
    """A lower bound on the iteration time from lower bounds ``stage_u`` on the stages' micro-batch times: each
    schedule's time (``cost_model.pipeline_time``) is non-decreasing in every ``U_s``. For zb-h1 a stage's bubble
    share ``U_s − 2 W_s`` is at least ``U_s / (1 + β)`` (``W_s`` is ``β/2`` of its forward compute and ``U_s``
    holds at least ``(1 + β)`` times it), so the bound holds without knowing ``W_s``. Where ranks share processors
    (``cost_model.shared_pipeline_time``) the path runs at a rank's speed alone, at least ``U_s / σ``, and the
    node's busy time is a mean of the ``U_s``: the larger of those two bounds."""
    if shared is not None:
        alone = [u / shared.slowdown for u in stage_u]
        busy = max(c * sum(stage_u[s] for s in stages) / len(stages) for stages in shared.node_stages(len(stage_u)))
        busy *= shared.busy_share(len(stage_u))
        return max(busy, bound_time(alone, c, schedule, virtual_stages, backward_coefficient))
    top = max(stage_u)
    rest = sum(stage_u) - top
    if schedule is PipelineSchedule.INTERLEAVED_1F1B and virtual_stages > 1:
        return c * top + rest / virtual_stages
    if schedule is PipelineSchedule.ZB_H1 and c >= len(stage_u):
        return c * top + rest / (1.0 + backward_coefficient)
    return c * top + rest


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
