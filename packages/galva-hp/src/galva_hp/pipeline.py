"""Pipeline execution: run a stage's schedule (:mod:`galva_comm.schedules`) with p2p between model chunks.

A stage holds one model chunk, or ``v`` of them under interleaved 1F1B (chunk ``c`` on stage ``c % pp``). Chunk ``c``
receives its input from chunk ``c - 1``'s stage and sends its output to chunk ``c + 1``'s stage (the last stage's
chunks send back to stage 0); gradients go the other way. Local rank ``i`` of a stage exchanges with local rank ``i``
of the other stages inside its pipeline group (:func:`galva_comm.layout.pipeline_groups`). A message is the tensor
alone wherever the receiver knows its dtype and shape, else a small header (dtype and shape) and then the tensor, so
chunks may hand over any layout, including the sequence-sharded ones, without a shape table. A gradient always has the
shape of the activation its receiver sent; an activation's shape is fixed by the plan and the micro-batch's input
shape (``shape_keys`` of :func:`run_schedule`), so both ends learn it from the first header for that key and send
it alone afterwards (a changed sequence length is a new key, hence a header). Skipping the header matters on gloo:
the tensor moves only once the receiver, having read the header, asks for it, and a sender computing again must
first get a processor back (measured: ~3 ms a message on loaded CPUs, against 0.8 ms for the tensor alone). The tag
names the receiving chunk and the direction, so messages of different chunks between the same two ranks never mix.
Sends are non-blocking and waited for at the end of the iteration. A receive whose shape is known is posted one
receiving step ahead, before the stage computes the step in between, so the message moves while it computes: on gloo a
message moves only once its receive is posted, and a receive posted when needed paid the transfer and the sender's
wake-up on the critical path (galva's interleaved 1F1B measured 0.94-1.03 of its 1F1B on 2 CPU ranks against 0.90-0.94
for torch's ``ScheduleInterleaved1F1B``, which posts its receives ahead too). Receives are posted in the steps' order,
as the other end sends, and a step waits only for its own receive, which is deadlock-free for every schedule whose
order :func:`~galva_comm.schedules.simulate` finishes.

Backward steps: ``B`` back-propagates a chunk's micro-batch in one autograd call. Zero-bubble schedules split it:
``I`` computes only the gradient of the chunk's input (what the previous chunk waits for) and ``W`` later computes
the weights' gradients from the intermediate gradients ``I`` kept, without running any node's input-gradient work
twice: ``I`` keeps, through node pre-hooks, the gradient reaching each node where weights' paths meet the input's, and
``W`` restarts autograd there (``torch.autograd.grad`` from ``GradientEdge`` to ``GradientEdge``), the scheme of the
zero-bubble paper and of ``torch.distributed.pipelining._backward``. Galva does its own graph walk: that private
module's package imports torch's compiler (0.9 s and 29 MiB a rank, for every job). The weights of a chunk are the leaf
tensors its graph accumulates into, found by walking the graph, so FSDP2's gathered parameters, shared parameters and
tied copies are all covered; a weight read by several layers of the chunk (T5's relative-position table) gets its
gradient in ``I`` instead (:func:`_split_weights` says why). A ``W`` writes ``.grad`` directly: no
post-accumulate-grad hook fires, so the hooks of :func:`run_schedule` tell the runtime which step finishes a chunk's
gradients.

The schedule never scales gradients: the loss each micro-batch back-propagates is already divided by the global
token count (unlike ``torch.distributed.pipelining``, whose default divides by the number of micro-batches).

Why Galva runs its own schedules instead of ``torch.distributed.pipelining``'s (measured, see
``benchmarks/runtime/README.md``): its ``PipelineStage`` treats a stage as one module under one data-parallel wrapper
(``DistributedDataParallel`` or a root ``fully_shard``), while a Galva stage holds one data-parallel unit per layer,
each on its own group and of its own type (ddp buckets reduced from post-accumulate hooks during the last backward,
zero2/zero3 per layer); with a split backward it keeps every FSDP2 module unsharded and unreduced until all weight
gradients are done. Driving it would mean re-implementing those reductions around it; the schedule itself is a
list of steps (this module and :mod:`galva_comm.schedules`, ~300 lines). On the same pp4 model galva's 1F1B
runs at the speed of ``Schedule1F1B`` (ratio in the benchmark README), so adopting it would buy no time.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from galva_comm.schedules import Step, schedule_order

__all__ = [
    "PipelineStage",
    "ScheduleHooks",
    "SplitBackward",
    "Step",
    "WeightGroup",
    "input_backward",
    "run_schedule",
    "schedule_order",
    "weight_backward",
]

Posted = tuple[Any, Tensor]  # a receive posted ahead of its step: its work and the tensor it fills
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype code, ndim, up to 8 dims


@dataclass
class PipelineStage:
    """This rank's place in its pipeline: its stage, and the global ranks of every stage of its pipeline group."""

    stage: int
    num_stages: int
    group: dist.ProcessGroup | None = None
    ranks: tuple[int, ...] = ()  # global rank of each stage's member of this pipeline
    num_chunks: int = 0  # model chunks over the pipeline (0: one per stage)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # of the p2p buffers
    _pending: list[Any] = field(default_factory=list, repr=False)
    # (tag, shape key) -> (dtype, shape) of the activations already described by a header, at either end
    _known: dict[tuple[int, Hashable], tuple[torch.dtype, torch.Size]] = field(default_factory=dict, repr=False)

    @property
    def chunks(self) -> int:
        return self.num_chunks or self.num_stages

    def _rank_of_chunk(self, chunk: int) -> int:
        return self.ranks[chunk % self.num_stages]

    # --------------------------------------------------------------------------------------------------- p2p
    def _send(self, tensor: Tensor, dst: int, tag: int, header: bool = True) -> None:
        tensor = tensor.detach().contiguous()
        if header:
            if tensor.ndim > _HEADER - 2:
                raise ValueError(f"cannot send a tensor of {tensor.ndim} dims between stages")
            values = [_DTYPES.index(tensor.dtype), tensor.ndim, *tensor.shape]
            described = torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=self.device)
            self._pending.append((dist.isend(described, dst, group=self.group, tag=tag), described))
        # keep the tensors alive until the sends complete
        self._pending.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor))

    def _recv(self, src: int, tag: int, like: tuple[torch.dtype, torch.Size] | None = None) -> Tensor:
        """A tensor from ``src``: of ``like``'s dtype and shape, or of those its header gives when ``like`` is None."""
        if like is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src, group=self.group, tag=tag)
            values = header.tolist()
            like = _DTYPES[values[0]], torch.Size(values[2 : 2 + values[1]])
        tensor = torch.empty(like[1], dtype=like[0], device=self.device)
        dist.recv(tensor, src, group=self.group, tag=tag)
        return tensor

    def _irecv(self, src: int, tag: int, like: tuple[torch.dtype, torch.Size]) -> Posted:
        tensor = torch.empty(like[1], dtype=like[0], device=self.device)
        return dist.irecv(tensor, src, group=self.group, tag=tag), tensor

    def post_forward(self, chunk: int, key: Hashable = None) -> Posted | None:
        """Post the receive of chunk ``chunk``'s input ahead of its step, where its shape is known (None: it comes
        with a header, received when needed)."""
        tag = 2 * chunk + 1
        known = None if key is None else self._known.get((tag, key))
        return None if known is None else self._irecv(self._rank_of_chunk(chunk - 1), tag, known)

    def post_backward(self, chunk: int, output: Tensor) -> Posted:
        """Post the receive of the gradient of chunk ``chunk``'s ``output`` ahead of its step."""
        return self._irecv(self._rank_of_chunk(chunk + 1), 2 * chunk + 2, (output.dtype, output.shape))

    def send_forward(self, chunk: int, activation: Tensor, key: Hashable = None) -> None:
        """Chunk ``chunk``'s output to chunk ``chunk + 1``; ``key`` (None: always a header) is what fixes its dtype
        and shape, the same at both ends (:func:`run_schedule`'s ``shape_keys``)."""
        tag = 2 * (chunk + 1) + 1
        known = None if key is None else self._known.get((tag, key))
        if known is not None and known != (activation.dtype, activation.shape):
            raise ValueError(
                f"pipeline: chunk {chunk}'s output changed to {activation.dtype} {tuple(activation.shape)} from "
                f"{known[0]} {tuple(known[1])} for the same micro-batch input shape {key}; an activation's shape "
                "must follow from the micro-batch's"
            )
        if key is not None and known is None:
            self._known[(tag, key)] = (activation.dtype, activation.shape)
        self._send(activation, self._rank_of_chunk(chunk + 1), tag, header=known is None)

    def recv_forward(self, chunk: int, key: Hashable = None, posted: Posted | None = None) -> Tensor:
        """Chunk ``chunk``'s input, from chunk ``chunk - 1`` (``key`` as in :meth:`send_forward`; ``posted``: the
        receive :meth:`post_forward` posted for it)."""
        tag = 2 * chunk + 1
        if posted is not None:
            posted[0].wait()
            return posted[1].requires_grad_(posted[1].is_floating_point())
        known = None if key is None else self._known.get((tag, key))
        tensor = self._recv(self._rank_of_chunk(chunk - 1), tag, known)
        if key is not None and known is None:
            self._known[(tag, key)] = (tensor.dtype, tensor.shape)
        return tensor.requires_grad_(tensor.is_floating_point())

    def send_backward(self, chunk: int, grad: Tensor) -> None:
        """The gradient of chunk ``chunk``'s input, to chunk ``chunk - 1`` (which knows its shape: no header)."""
        self._send(grad, self._rank_of_chunk(chunk - 1), 2 * (chunk - 1) + 2, header=False)

    def recv_backward(self, chunk: int, output: Tensor, posted: Posted | None = None) -> Tensor:
        """The gradient of chunk ``chunk``'s ``output`` (what this stage sent on), from chunk ``chunk + 1``
        (``posted``: the receive :meth:`post_backward` posted for it)."""
        if posted is not None:
            posted[0].wait()
            return posted[1]
        return self._recv(self._rank_of_chunk(chunk + 1), 2 * chunk + 2, (output.dtype, output.shape))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class ScheduleHooks(Protocol):
    """What :func:`run_schedule` calls on the stage it runs."""

    def forward(self, chunk: int, received: Tensor | None, k: int) -> Any:
        """Run chunk ``chunk`` on micro-batch ``k`` (``received`` is None for chunk 0); return the activation to
        send on, or for the last chunk whatever :meth:`loss` turns into the scalar to back-propagate."""

    def loss(self, out: Any) -> Tensor: ...

    def before_backward(self, chunk: int, k: int, final: bool, split: bool) -> None:
        """Before the step that writes chunk ``chunk``'s weight gradients of micro-batch ``k`` (``B``, or ``W`` when
        ``split``); ``final`` marks the chunk's last such step of the iteration (its gradients are then complete)."""

    def after_backward(self, chunk: int, k: int, final: bool, split: bool) -> None:
        """After that step."""

    def before_input_backward(self, chunk: int, k: int) -> None:
        """Before an ``I`` step (a split backward's input-gradient half)."""


def run_schedule(
    pipe: PipelineStage, order: Sequence[Step], hooks: ScheduleHooks, shape_keys: Sequence[Hashable] | None = None
) -> list[Any]:
    """Run one iteration's steps on this stage, in ``order``; return the last chunk's forward outputs.

    ``shape_keys[k]``, the same on every stage, is what fixes the shapes of micro-batch ``k``'s activations (the
    runtime's: its input's and labels' shapes); an activation then goes without a header once one was sent for its
    chunk and key. None: every activation carries its header."""
    last_chunk = pipe.chunks - 1
    saved: dict[tuple[int, int], tuple[Tensor | None, Any]] = {}
    pending_weights: dict[tuple[int, int], SplitBackward] = {}
    outputs: list[Any] = []
    final = {}  # chunk -> position of the step that finishes its weight gradients
    for position, step in enumerate(order):
        if step.kind in "BW":
            final[step.chunk] = position
    # positions whose step receives: a forward of a chunk > 0, a backward of a chunk before the last
    receiving = [
        p
        for p, (kind, chunk, _) in enumerate(order)
        if (chunk > 0 if kind == "F" else kind in "BI" and chunk < last_chunk)
    ]
    posted: dict[int, Posted] = {}

    def post_next(after: int) -> None:
        """Post the receive of the next receiving step after position ``after`` now, where its shape is known, so
        that the message moves while this stage computes (on gloo a message moves only once its receive is posted).
        Only the next one: receives are posted in the steps' order, as the sends of the other end are made."""
        index = bisect.bisect_right(receiving, after)
        if index == len(receiving) or receiving[index] in posted:
            return
        at = receiving[index]
        kind, chunk, k = order[at]
        if kind == "F":
            receive = pipe.post_forward(chunk, None if shape_keys is None else shape_keys[k])
        else:
            sent = saved.get((chunk, k))
            receive = None if sent is None else pipe.post_backward(chunk, sent[1])
        if receive is not None:
            posted[at] = receive

    for position, (kind, chunk, k) in enumerate(order):
        if kind == "F":
            key = None if shape_keys is None else shape_keys[k]
            received = None if chunk == 0 else pipe.recv_forward(chunk, key, posted.pop(position, None))
            post_next(position)
            out = hooks.forward(chunk, received, k)
            if chunk == last_chunk:
                outputs.append(out)
            else:
                pipe.send_forward(chunk, out, key)
            saved[(chunk, k)] = (received, out)
            post_next(position)  # a backward's receive needs this forward's output first
            continue
        is_final = final.get(chunk) == position
        if kind == "W":
            post_next(position)
            split = pending_weights.pop((chunk, k))
            hooks.before_backward(chunk, k, is_final, True)
            weight_backward(split)
            hooks.after_backward(chunk, k, is_final, True)
            continue
        received, out = saved.pop((chunk, k))
        if chunk == last_chunk:
            roots, grads = [hooks.loss(out)], None
        else:
            roots, grads = [out], [pipe.recv_backward(chunk, out, posted.pop(position, None))]
        post_next(position)
        if kind == "B":
            hooks.before_backward(chunk, k, is_final, False)
            torch.autograd.backward(roots, grads)
            hooks.after_backward(chunk, k, is_final, False)
        else:  # "I"
            if received is None:
                raise ValueError(f"chunk {chunk} has no input to split its backward at")
            hooks.before_input_backward(chunk, k)
            pending_weights[(chunk, k)] = input_backward(roots, grads, received)
        if chunk > 0:
            assert received is not None and received.grad is not None, f"chunk {chunk}'s input received no gradient"
            pipe.send_backward(chunk, received.grad)
    pipe.wait_sends()
    return outputs


@dataclass
class WeightGroup:
    """Weights whose gradient paths all meet the input-gradient path at one node: ``W`` restarts autograd there,
    from the gradient that node received during ``I``."""

    node: Node
    weights: list[Tensor] = field(default_factory=list)
    accumulators: list[Node] = field(default_factory=list)  # each weight's accumulate-grad node
    grads: tuple[Tensor | None, ...] = ()  # what ``node`` received in ``I``; empty until then (or if it never ran)

    def keep(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        """The pre-hook ``I`` puts on ``node``."""
        self.grads = tuple(grad_outputs)


SplitBackward = list[WeightGroup]
"""What ``W`` needs of an ``I``: the groups of the weights it left."""


def input_backward(roots: Sequence[Tensor], grads: Sequence[Tensor] | None, received: Tensor) -> SplitBackward:
    """A split backward's ``I``: the gradient of ``received`` (into its ``.grad``) and of the weights
    :func:`_split_weights` leaves to it, keeping what :func:`weight_backward` needs for the other weights' gradients:
    the gradient each group's node received.
    (galva-profile times this pair against one ``torch.autograd.backward``: zb-h1's overhead per layer.)"""
    groups, with_input = _split_weights(roots, received)
    handles = [group.node.register_prehook(group.keep) for group in groups]
    targets = [received, *with_input]
    try:
        found = torch.autograd.grad(
            list(roots),
            targets,
            None if grads is None else list(grads),
            retain_graph=True,  # ``W`` starts again from the groups' nodes, through their saved tensors
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    _accumulate(targets, found)
    for root in roots:
        root.detach_()  # the output side of the graph is done: free what it holds before ``W``
    return groups


def weight_backward(split: SplitBackward) -> None:
    """A split backward's ``W``: the remaining weights' gradients, accumulated into their ``.grad``; one autograd
    call per group, each from its node down to its weights only (their paths never cross another group's)."""
    for group in split:
        edges = [(GradientEdge(group.node, i), g) for i, g in enumerate(group.grads) if g is not None]
        group.grads = ()
        if not edges:
            continue  # autograd never reached the node: no gradient for these weights
        found = torch.autograd.grad(
            [edge for edge, _ in edges],
            [GradientEdge(node, 0) for node in group.accumulators],
            [g for _, g in edges],
            allow_unused=True,
        )
        _accumulate(group.weights, found)


def _accumulate(tensors: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Add each gradient into its tensor's ``.grad``, as autograd's own accumulation does."""
    for tensor, grad in zip(tensors, grads, strict=True):
        if grad is not None:
            tensor.grad = grad if tensor.grad is None else tensor.grad + grad


def _split_weights(roots: Sequence[Tensor], received: Tensor) -> tuple[list[WeightGroup], list[Tensor]]:
    """The leaf tensors (parameters) the autograd graph of ``roots`` accumulates gradients into, but ``received``:
    those whose gradients ``W`` computes, grouped by the node where their paths meet the input-gradient path (the
    nodes the gradient of ``received`` runs through), and those ``I`` computes with the input's.

    ``W`` restarts autograd at that node, with the gradient ``I`` left there. A weight whose paths meet the
    input-gradient path at several nodes, one behind the other (a parameter read by two layers of the chunk: T5's
    relative-position table, any shared weight), would make ``W`` run the input-gradient path between those nodes
    again: twice the chunk's backward between them, through saved tensors that the ``W`` of other weights has
    already freed ("backward through the graph a second time"). Such a weight's gradient is cheap to take in ``I``,
    which walks that path anyway; so is one whose paths never meet it."""
    seen: set[Node] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    users: dict[Node, list[Node]] = collections.defaultdict(list)  # node -> the nodes that pass it gradients
    leaves: dict[Node, Tensor] = {}  # accumulate-grad node -> its leaf (plain leaf tensors too, as autograd does)
    inputs: list[Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is received:
            inputs.append(node)
        elif isinstance(variable, Tensor):
            leaves[node] = variable
        for fn, _ in node.next_functions:
            if fn is not None:
                users[fn].append(node)
                stack.append(fn)
    on_input_path = _reached(inputs, users, stop=frozenset())
    groups: dict[Node, WeightGroup] = {}
    with_input: list[Tensor] = []
    for accumulator, leaf in leaves.items():
        met = _reached([accumulator], users, stop=on_input_path) & on_input_path
        if len(met) != 1:
            with_input.append(leaf)
            continue
        (node,) = met
        group = groups.setdefault(node, WeightGroup(node))
        group.weights.append(leaf)
        group.accumulators.append(accumulator)
    return list(groups.values()), with_input


def _reached(starts: list[Node], users: dict[Node, list[Node]], stop: AbstractSet[Node]) -> set[Node]:
    """The nodes gradients flow from to ``starts`` (``starts`` included), not walking on past those in ``stop``."""
    reached = set(starts)
    queue = collections.deque(starts)
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user not in reached:
                reached.add(user)
                if user not in stop:
                    queue.append(user)
    return reached
