"""What a plan costs: iteration time, memory and micro-batch time per stage (docs/cost-model.md §7).

:func:`task_cost` scores a task whose stages have chosen their candidates; the search uses it for every solved task
and :func:`evaluate_strategy` for any written :class:`galva_schema.Strategy`, so both score a plan the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from galva_schema import DataParallelType, SchemaError, Strategy
from galva_search.convert import candidate_of
from galva_search.cost_model import CostModel, VocabOption, iteration_time
from galva_search.tasks import LayerSequence, Task, build_tables


@dataclass(frozen=True)
class PlanCost:
    """Predicted cost of a plan."""

    iteration_time_s: float
    stage_memory_mib: list[float]  # per device, vocabulary layers, transients and framework context included
    stage_time_s: list[float]  # seconds per micro-batch
    stage_states_mib: list[float] = field(default_factory=list)  # model states (layers + vocabulary)
    stage_activation_mib: list[float] = field(default_factory=list)  # activations of ONE micro-batch
    stage_in_flight: list[int] = field(default_factory=list)  # micro-batches whose activations are held at the peak
    stage_transient_mib: list[float] = field(default_factory=list)  # the largest transient of any layer of the stage
    stage_exposed_s: list[float] = field(default_factory=list)  # gradient-sync tail per stage
    # stage_time_s split by kind (each list sums, over its stage, to stage_time_s): layer forward + backward +
    # recomputation and the vocabulary layers (their tp all-reduces included); tp / Megatron-SP / Ulysses
    # collectives; ZeRO-3 gathers; p2p sends; re-sharding between layers of different layouts
    stage_parts_s: dict[str, list[float]] = field(default_factory=dict)

    def time_breakdown_s(self, num_micro_batches: int) -> dict[str, float]:
        """Seconds of one iteration by kind: ``compute``, ``tp``, ``dp``, ``p2p``, ``redistribution``, ``bubble``.

        The slowest stage sets the pace: its micro-batch time, split by kind, counts ``num_micro_batches`` times;
        the other stages' micro-batch times (pipeline fill and drain) are the ``bubble``; the gradient-sync tail
        after the last backward is ``dp``. The parts sum to ``iteration_time_s``.
        """
        if not self.stage_time_s or not self.stage_parts_s:
            return {}
        slowest = max(range(len(self.stage_time_s)), key=lambda k: self.stage_time_s[k])
        out = {kind: num_micro_batches * parts[slowest] for kind, parts in self.stage_parts_s.items()}
        out["bubble"] = sum(self.stage_time_s) - self.stage_time_s[slowest]
        out["dp"] = out.get("dp", 0.0) + max(0.0, self.iteration_time_s - sum(out.values()))
        return out


def task_cost(cost: CostModel, layers: LayerSequence, task: Task, choices: Sequence[Sequence[int]]) -> PlanCost:
    """Cost of ``task`` when stage ``s`` runs its layers under ``task.tables.candidates[choices[s][i]]``.

    Every re-sharding the runtime does is priced where it happens: between neighbours of a stage, from the
    embedding into the first layer, from the last layer into the head, and on the receiving stage after a p2p
    (which carries the sending layer's layout both ways, so the backward p2p is sized by that layer too).
    """
    c = task.micro_batches
    tables = task.tables
    in_flight = cost.in_flight(task.pp, c)
    from_embedding, to_head = cost.vocab_boundaries(task.vocab, tables.candidates, task.micro_batch)
    u_list, e_list, mem_list, states_list, act_list, transient_list = [], [], [], [], [], []
    parts: dict[str, list[float]] = {k: [] for k in ("compute", "tp", "dp", "p2p", "redistribution")}
    prev: tuple[int, int] | None = None  # (type, candidate) of the layer before, on this stage or the previous one
    for stage, (types, choice) in enumerate(zip(layers.stage_types(task.division), choices)):
        vt = task.vocab_terms[stage]
        u, e = vt.micro_batch_s, vt.exposed_sync_s
        mem = vt.memory_mib + cost.settings.context_mib
        states, act, transient = vt.states_mib, vt.activation_mib, 0.0
        part = dict.fromkeys(parts, 0.0)
        part["compute"] = vt.micro_batch_s
        for pos, (t, s) in enumerate(zip(types, choice)):
            terms = tables.terms[t]
            u += float(terms.micro_batch_s[s])
            part["compute"] += float(terms.forward_s[s] + terms.backward_s[s])
            part["tp"] += float(terms.tp_comm_s[s])
            part["dp"] += float(terms.zero3_comm_s[s])
            e += float(terms.exposed_sync_s[s])
            mem += float(terms.memory_mib(in_flight[stage])[s])
            states += float(terms.states_mib[s])
            act += float(terms.activation_mib[s])
            transient = max(transient, float(terms.transient_mib[s]))
            reshard = float(from_embedding[s]) if prev is None else float(tables.redistribution[t][prev[1], s])
            u += reshard
            part["redistribution"] += reshard
            if pos == 0 and prev is not None:
                u += float(tables.terms[prev[0]].p2p_s[prev[1]])  # backward gradient sent to the previous stage
                part["p2p"] += float(tables.terms[prev[0]].p2p_s[prev[1]])
            if pos == len(types) - 1 and stage < task.pp - 1:
                u += float(terms.p2p_s[s])  # forward activation sent to the next stage
                part["p2p"] += float(terms.p2p_s[s])
            prev = (t, s)
        u_list.append(u)
        e_list.append(e)
        mem_list.append(mem + transient)
        states_list.append(states)
        act_list.append(act)
        transient_list.append(transient)
        for kind, value in part.items():
            parts[kind].append(value)
    if prev is not None:
        u_list[-1] += float(to_head[prev[1]])
        parts["redistribution"][-1] += float(to_head[prev[1]])
    return PlanCost(
        iteration_time(u_list, e_list, c),
        mem_list,
        u_list,
        states_list,
        act_list,
        in_flight,
        transient_list,
        e_list,
        parts,
    )


@dataclass(frozen=True)
class Evaluation:
    """Predicted cost of one given strategy."""

    iteration_time_s: float
    throughput: float  # samples per second
    stage_memory_mib: list[float]
    detail: PlanCost | None = None  # the per-stage breakdown (states, activations, transients, times)


def evaluate_strategy(cost: CostModel, strategy: Strategy) -> Evaluation:
    """Predict iteration time, throughput and per-stage memory of ``strategy`` (hand-written, or another tool's).

    Uses the same terms the search optimises; the cost model's settings (precision, schedule, default dp type,
    Megatron-SP) are taken from the strategy, so a plan is always scored as it would run.
    """
    if strategy.world_size != cost.world_size:
        raise SchemaError(f"world_size: the strategy has {strategy.world_size} ranks, the cluster {cost.world_size}")
    if strategy.num_layers != cost.model.num_layers:
        raise SchemaError(f"layers: the strategy has {strategy.num_layers} layers, the model {cost.model.num_layers}")
    settings = replace(
        cost.settings,
        precision=strategy.mixed_precision,
        pipeline_schedule=strategy.pipeline_schedule,
        default_dp_type=strategy.default_dp_type,
        megatron_sp=strategy.megatron_sp,
    )
    cost = CostModel(
        cost.hardware, cost.model, settings, hardware_source=cost.comm.source, model_source=cost.model_source
    )
    c, pp, micro = strategy.num_micro_batches, strategy.pp, strategy.micro_batch_size
    per_layer = [candidate_of(strategy, i) for i in range(strategy.num_layers)]
    candidates = sorted(set(per_layer))
    index = {cand: i for i, cand in enumerate(candidates)}
    tables = build_tables(cost, candidates, micro, c > 1)
    vocab = VocabOption(
        tp=strategy.vocab.tp, sp=strategy.vocab.sp, zero3=strategy.vocab_dp_type is DataParallelType.ZERO3
    )
    vocab_terms = cost.vocab_terms(pp, vocab, micro, c, cost.in_flight(pp, c))
    task = Task(strategy.global_batch_size, c, pp, tuple(strategy.pp_division), vocab, tables, vocab_terms)
    layers = LayerSequence([lt.num_layers for lt in cost.model.layer_types])
    choices = [[index[per_layer[i]] for i in strategy.stage_layers(stage)] for stage in range(pp)]
    got = task_cost(cost, layers, task, choices)
    return Evaluation(
        got.iteration_time_s,
        strategy.global_batch_size / got.iteration_time_s,
        [float(m) for m in got.stage_memory_mib],
        got,
    )
