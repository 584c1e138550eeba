"""What a plan costs: iteration time, memory and micro-batch time per stage (docs/cost-model.md §7).

:func:`task_cost` scores a task whose stages have chosen their candidates; the search uses it for every solved task
and :func:`evaluate_strategy` for any written :class:`galva_schema.Strategy`, so both score a plan the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from galva_schema import DataParallelType, PipelineSchedule, SchemaError, Strategy
from galva_schema.constraints import layers_problem, world_size_problem
from galva_search.convert import candidate_of
from galva_search.cost_model import (
    CostModel,
    VocabOption,
    interleaved_chunks_in_flight,
    pipeline_time,
    shared_pipeline_time,
)
from galva_search.cost_tables import build_tables
from galva_search.layer_sequence import LayerSequence
from galva_search.tasks import Task


@dataclass(frozen=True)
class PlanCost:
    """Predicted cost of a plan."""

    iteration_time_s: float
    stage_memory_mib: list[float]  # per device, vocabulary layers, transients and framework context included
    stage_time_s: list[float]  # seconds per micro-batch
    stage_states_mib: list[float] = field(default_factory=list)  # model states (layers + vocabulary)
    stage_activation_mib: list[float] = field(default_factory=list)  # activations of ONE micro-batch
    # micro-batches whose activations are held at the peak; interleaved: micro-batch-chunks, each 1/v of the stage's
    # activations of one micro-batch (stage_activation_mib * stage_in_flight / virtual_stages is the stage's peak)
    stage_in_flight: list[int] = field(default_factory=list)
    stage_transient_mib: list[float] = field(default_factory=list)  # the largest transient of any layer of the stage
    stage_exposed_s: list[float] = field(default_factory=list)  # gradient-sync tail per stage
    # stage_time_s split by kind (each list sums, over its stage, to stage_time_s): layer forward + backward +
    # recomputation and the vocabulary layers (their tp all-reduces included); tp / Megatron-SP / Ulysses
    # collectives; ZeRO-3 gathers; p2p sends; re-sharding between layers of different layouts
    stage_parts_s: dict[str, list[float]] = field(default_factory=dict)
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1
    stage_weight_grad_s: list[float] = field(default_factory=list)  # weight-gradient work per micro-batch (zb-h1)
    bubble_s: float | None = None  # fill and drain of the pipeline (cost_model.pipeline_time); None: 1F1B's
    optimizer_s: float = 0.0  # the optimizer step after the pipeline, slowest stage (inside iteration_time_s)

    def time_breakdown_s(self, num_micro_batches: int) -> dict[str, float]:
        """Seconds of one iteration by kind: ``compute``, ``tp``, ``dp``, ``p2p``, ``redistribution``, ``bubble``,
        ``optimizer``.

        The slowest stage sets the pace: its micro-batch time, split by kind, counts ``num_micro_batches`` times;
        what the schedule's fill and drain add is the ``bubble``; the gradient-sync tail after the last backward is
        ``dp``. The parts sum to ``iteration_time_s``. Where ranks share processors the pipeline can take less than
        the slowest stage's micro-batches at the all-at-once speed (a negative ``bubble_s``: the processors idle ranks
        hand over speed the others up, cost_model.shared_pipeline_time); the bubble is then 0 and the slowest
        stage's kinds shrink in proportion.
        """
        if not self.stage_time_s or not self.stage_parts_s:
            return {}
        slowest = max(range(len(self.stage_time_s)), key=lambda k: self.stage_time_s[k])
        out = {kind: num_micro_batches * parts[slowest] for kind, parts in self.stage_parts_s.items()}
        bubble = self.bubble_s if self.bubble_s is not None else sum(self.stage_time_s) - self.stage_time_s[slowest]
        steady = sum(out.values())
        if bubble < 0.0 and steady > 0.0:
            out = {kind: value * max(0.0, steady + bubble) / steady for kind, value in out.items()}
        out["bubble"] = max(0.0, bubble)
        out["optimizer"] = self.optimizer_s
        out["dp"] = out.get("dp", 0.0) + max(0.0, self.iteration_time_s - sum(out.values()))
        return out


def task_cost(cost: CostModel, layers: LayerSequence, task: Task, choices: Sequence[Sequence[int]]) -> PlanCost:
    """Cost of ``task`` when stage ``s`` runs its layers (``layers.stage_layers``: its model chunks in model order)
    under ``task.tables.candidates[choices[s][i]]``.

    Every re-sharding the runtime does is priced where it happens: between neighbours of a chunk, from the
    embedding into the first layer, from the last layer into the head, and on the receiving stage after a p2p
    (which carries the sending layer's layout both ways, so the backward p2p is sized by that layer too). Every
    boundary between model chunks is one p2p each way (``pp·v − 1`` of them, the interleaved wrap from the last
    stage back to stage 0 included), the forward send charged to the sending stage, the backward one to the
    receiving stage.
    """
    c, pp = task.micro_batches, task.pp
    tables = task.tables
    in_flight = cost.in_flight(pp, c, task.schedule, task.virtual_stages)
    chunks_held = (
        interleaved_chunks_in_flight(pp, c, task.virtual_stages)
        if task.schedule is PipelineSchedule.INTERLEAVED_1F1B and task.virtual_stages > 1 and pp > 1
        else [round(n) for n in in_flight]
    )
    from_embedding, to_head = tables.vocab_boundaries(cost, task.vocab, task.micro_batch)
    kinds = ("compute", "tp", "dp", "p2p", "redistribution")
    u_list = [vt.micro_batch_s for vt in task.vocab_terms]
    e_list = [vt.exposed_sync_s for vt in task.vocab_terms]
    w_list = [vt.weight_grad_s for vt in task.vocab_terms]
    mem_list = [vt.memory_mib + cost.settings.context_mib for vt in task.vocab_terms]
    states_list = [vt.states_mib for vt in task.vocab_terms]
    act_list = [vt.activation_mib for vt in task.vocab_terms]
    transient_list = [0.0] * pp
    # the optimizer step: measured per layer type and for the vocabulary where profiled (LayerTerms.step_s, a ZeRO
    # layer's sharded step included; VocabTerms.step_s), else the hardware's rate on the states it covers
    step_list = [cost.optimizer_call_s() + vt.step_s for vt in task.vocab_terms]
    measured_vocab = cost.model.vocab.optimizer_step_ms is not None
    rate_states = [0.0 if measured_vocab else vt.states_mib for vt in task.vocab_terms]
    parts: dict[str, list[float]] = {k: [0.0] * pp for k in kinds}
    parts["compute"] = list(u_list)
    # the layers' forward and forward + backward compute: the forward's share of a stage (shared processors)
    forward_list, layer_list = [0.0] * pp, [0.0] * pp
    for stage, vt in enumerate(task.vocab_terms):  # a ZeRO-2 vocabulary gathers again before each micro-batch
        u_list[stage] += vt.regather_s * (c - 1) / c
        parts["dp"][stage] += vt.regather_s * (c - 1) / c
    candidate_of: dict[int, int] = {}
    for stage, held in enumerate(layers.stage_layers(task.division, pp)):
        candidate_of.update(zip(held, choices[stage]))
    chunks = layers.chunk_layers(task.division)
    # zb-h1 splits the backward on every stage but the first (whose input gradient nobody waits for)
    split = task.schedule is PipelineSchedule.ZB_H1 and pp > 1
    prev: tuple[int, int] | None = None  # (type, candidate) of the layer before in the model
    for chunk, indices in enumerate(chunks):
        stage = chunk % pp
        count = Counter(layers.type_of[i] for i in indices)  # a ddp layer's sync: its share of its chunk's buckets
        for pos, i in enumerate(indices):
            t, s = layers.type_of[i], candidate_of[i]
            terms = tables.terms[t]
            u = float(terms.micro_batch_s[s])
            parts["compute"][stage] += float(terms.forward_s[s] + terms.backward_s[s])
            forward_list[stage] += float(terms.forward_s[s])
            layer_list[stage] += float(terms.forward_s[s] + terms.backward_s[s])
            if split and stage > 0:
                overhead = cost.split_backward_overhead_s(t)
                u += overhead
                parts["compute"][stage] += overhead
            parts["tp"][stage] += float(terms.tp_comm_s[s])
            parts["dp"][stage] += float(terms.zero3_comm_s[s])
            if len(terms.regather_s) and c > 1:  # ZeRO-2 gathers again before each micro-batch: c - 1 more
                regather = float(terms.regather_s[s]) * (c - 1) / c
                u += regather
                parts["dp"][stage] += regather
            e_list[stage] += float(tables.sync_share(cost, t, count[t])[s])
            if len(terms.weight_grad_s):
                w_list[stage] += float(terms.weight_grad_s[s])
            if len(terms.step_s):
                step_list[stage] += float(terms.step_s[s])
            if cost.model.layer_types[t].optimizer_step_ms is None:
                rate_states[stage] += float(terms.states_mib[s])
            mem_list[stage] += float(terms.states_mib[s] + in_flight[stage] * terms.activation_mib[s])  # memory_mib
            states_list[stage] += float(terms.states_mib[s])
            act_list[stage] += float(terms.activation_mib[s])
            transient_list[stage] = max(transient_list[stage], float(terms.transient_mib[s]))
            reshard = float(from_embedding[s]) if prev is None else float(tables.redistribution[t][prev[1], s])
            u += reshard
            parts["redistribution"][stage] += reshard
            if pos == 0 and prev is not None:
                back = float(tables.terms[prev[0]].p2p_s[prev[1]])  # backward gradient sent to the previous chunk
                u += back
                parts["p2p"][stage] += back
            if pos == len(indices) - 1 and chunk < len(chunks) - 1:
                fwd = float(terms.p2p_s[s])  # forward activation sent to the next chunk
                u += fwd
                parts["p2p"][stage] += fwd
            u_list[stage] += u
            prev = (t, s)
    if prev is not None:
        u_list[-1] += float(to_head[prev[1]])
        parts["redistribution"][-1] += float(to_head[prev[1]])
    mem_list = [m + tr for m, tr in zip(mem_list, transient_list)]
    shared = cost.shared_processors(pp)
    if shared is None:
        timing = pipeline_time(u_list, e_list, c, task.schedule, task.virtual_stages, w_list)
    else:
        share = [f / m if m > 0.0 else 1.0 / 3.0 for f, m in zip(forward_list, layer_list)]
        timing = shared_pipeline_time(
            u_list, parts["compute"], e_list, c, shared, task.schedule, task.virtual_stages, w_list, share
        )
    # every stage steps its optimizer once the pipeline has drained; the iteration waits for the slowest
    optimizer = max(cost.optimizer_s(states) + step for states, step in zip(rate_states, step_list))
    return PlanCost(
        timing.total + optimizer,
        mem_list,
        u_list,
        states_list,
        act_list,
        chunks_held,
        transient_list,
        e_list,
        parts,
        task.schedule,
        task.virtual_stages,
        w_list,
        timing.bubble,
        optimizer,
    )


@dataclass(frozen=True)
class Evaluation:
    """Predicted cost of one given strategy."""

    iteration_time_s: float
    throughput_samples_per_s: float
    stage_memory_mib: list[float]
    detail: PlanCost | None = None  # the per-stage breakdown (states, activations, transients, times)


def evaluate_strategy(cost: CostModel, strategy: Strategy) -> Evaluation:
    """Predict iteration time, throughput and per-stage memory of ``strategy`` (hand-written, or another tool's).

    Uses the same terms the search optimises; the cost model's settings (precision, schedule, default dp type,
    Megatron-SP) are taken from the strategy, so a plan is always scored as it would run.
    """
    model = cost.model
    if problem := world_size_problem(strategy, cost.world_size) or layers_problem(
        strategy, model.num_layers, model.model_name
    ):
        raise SchemaError(problem)
    settings = cost.settings.for_strategy(strategy)
    cost = CostModel(
        cost.hardware, cost.model, settings, hardware_source=cost.comm.source, model_source=cost.model_source
    )
    c, pp, micro = strategy.num_micro_batches, strategy.pp, strategy.micro_batch_size
    per_layer = [candidate_of(strategy, i) for i in range(strategy.num_layers)]
    candidates = sorted(set(per_layer), key=repr)  # expert_dp_type may be None beside a type: repr orders all
    index = {cand: i for i, cand in enumerate(candidates)}
    tables = build_tables(cost, candidates, micro, c > 1)
    vocab = VocabOption(
        tp=strategy.vocab.tp,
        sp=strategy.vocab.sp,
        zero3=strategy.vocab_dp_type is DataParallelType.ZERO3,
        cp=strategy.vocab.cp,
    )
    schedule, v = strategy.pipeline_schedule, strategy.virtual_stages
    vocab_terms = cost.vocab_terms(pp, vocab, micro, c, cost.in_flight(pp, c, schedule, v))
    task = Task(
        strategy.global_batch_size, c, pp, tuple(strategy.pp_division), vocab, tables, vocab_terms,
        schedule=schedule, virtual_stages=v,
    )
    layers = LayerSequence([lt.num_layers for lt in cost.model.layer_types])
    choices = [[index[per_layer[i]] for i in strategy.stage_layers(stage)] for stage in range(pp)]
    got = task_cost(cost, layers, task, choices)
    return Evaluation(
        got.iteration_time_s,
        strategy.global_batch_size / got.iteration_time_s,
        [float(m) for m in got.stage_memory_mib],
        got,
    )
