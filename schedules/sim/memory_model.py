"""The memory model: what each stage holds, and when, so a simulated step has each rank's bytes over time.

Per stage (bytes; one number for every stage, or one per stage)::

    state        the whole step: parameters, gradients, optimizer state (state_bytes)
    activation   one micro-batch, from the end of its F until its B (or W) ends: its input, its
                 output and what autograd saved for the backward
    after_input  of those, what a split backward's I leaves for W (default: all of it)
    boundary     the stage's output for one micro-batch: as a received input, from the recv's post
                 until the F that takes it (then it is part of that stage's activation)
    gradient     the gradient of the stage's output: received (or handed over) until the B or I
                 that takes it; sent upstream, from the B or I that makes it until the send ends
    transient    the most a forward holds above the level it started at, while it runs (its
                 temporaries and what it keeps; the loss's on the last stage); backward_transient,
                 input_transient and weight_transient: the same for B, I and W (default: transient)
    first_transient   the transient of the stage's first B (or W) in the step, which makes the parameter
                 gradients the later ones add to (None: as the later ones)
    grads_late   of the state, the parameter gradients that do not exist when the step starts (an
                 optimizer's zero_grad sets them to None): they arrive with the stage's first B or W
    sync         what the stage's gradient all-reduce (AR) holds from its start to the step's end
                 (its flat buffers); tie_sync, per tie group, what its TR holds on each holder
    optimizer    the optimizer step's temporaries over the stage's parameters, above the state: the
                 step after the pipeline's is a peak of its own (``optimizer_peak``), and the larger
                 of the two is what must fit (``required``)
    gathered     sharded data parallel (FSDP): the stage's parameters gathered whole, from its first
                 F until its AR reshards them (state then counts each replica's shards)
    gathered_grads   FSDP: the stage's whole (unsharded) gradients, made by its first B or W and added
                 to until its AR reduce-scatters them; its grads_late (the shards) arrive at that AR
    reduce_held  FSDP: what the stage's AR leaves held until the step's end (FSDP2 keeps a unit's
                 reduce-scatter input, its whole gradients, until the root's final callback)
    reduce_transient   FSDP: the most the AR holds above its start while it runs (a unit's shards, made
                 before its whole gradients go)
    gather_transient   FSDP: what the stage's first compute, which gathers its parameters, holds above
                 them while it runs (FSDP2's all-gather output, copied out into the parameters)

A sent gradient is freed when the send completes: where the transport takes the bytes at once
(``buffered_sends``: gloo, the in-process loopback), as its rank goes on to its next action
(the executor lets finished sends go there), else once its recv is posted too (NCCL's
rendezvous).

A handed-over input (the previous stage on the same rank) is that stage's output: one tensor,
counted once, from the earlier stage's F until the later of the two stages lets it go (a stage
lets its output, or its input, go at the end of its B; under a split backward at its I, unless
``output_after_input`` / ``input_after_input`` say it is still held until W). At unit sizes (activation 1, all else 0)
a rank's peak is the most micro-batches it holds, as published: GPipe m on every rank, 1F1B
p - i on rank i, ZB-H1 p at most, ZB-V about 1F1B's peak on every rank.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from itertools import accumulate

from schedules.ir.dataflow import Dataflow, Message
from schedules.ir.instructions import Action, Instruction, Kind, ops_of
from schedules.sim.memo import ByIdentity
from schedules.sim.perstage import PerStage, expand

__all__ = ["Memory", "peaks", "state_bytes", "track"]

ADAMW = 2  # optimizer copies of each parameter: AdamW's two moments


def state_bytes(parameter_bytes: float, optimizer_copies: int = ADAMW) -> float:
    """What a stage holds for the whole step: its parameters, their gradients and the optimizer's copies."""
    return parameter_bytes * (2 + optimizer_copies)


@dataclass(frozen=True)
class Memory:
    """Bytes of each stage, as the module docstring says; ``Costs(memory=...)`` gives them to the simulator."""

    state: PerStage = 0.0
    activation: PerStage = 1.0
    after_input: PerStage | None = None
    boundary: PerStage = 0.0
    gradient: PerStage = 0.0
    transient: PerStage = 0.0
    backward_transient: PerStage | None = None
    input_transient: PerStage | None = None
    weight_transient: PerStage | None = None
    first_transient: PerStage | None = None
    grads_late: PerStage = 0.0
    sync: PerStage = 0.0
    tie_sync: tuple[float, ...] = ()
    optimizer: PerStage = 0.0
    gathered: PerStage = 0.0
    gathered_grads: PerStage = 0.0
    reduce_held: PerStage = 0.0
    reduce_transient: PerStage = 0.0
    gather_transient: PerStage = 0.0
    output_after_input: PerStage = 1.0  # 1: a split backward's I leaves the stage's output held until W; 0: lets go
    input_after_input: PerStage = 1.0  # the same for the stage's input
    buffered_sends: bool = False

    def per_stage(self, num_stages: int) -> dict[str, list[float]]:
        """Every field expanded to one float per stage (checked): made once per Memory and stage count (a search
        reads it several times a candidate), so the table is shared: copy a list before changing it."""
        kept = self.__dict__.get("_table")
        if kept is not None and kept[0] == num_stages:
            return kept[1]  # type: ignore[no-any-return]
        table = self._expanded(num_stages)
        object.__setattr__(self, "_table", (num_stages, table))  # frozen: a cache beside the fields, not one of them
        return table

    def _expanded(self, num_stages: int) -> dict[str, list[float]]:
        names = (
            "state",
            "activation",
            "boundary",
            "gradient",
            "transient",
            "output_after_input",
            "input_after_input",
            "sync",
            "optimizer",
            "grads_late",
            "gathered",
            "gathered_grads",
            "reduce_held",
            "reduce_transient",
            "gather_transient",
        )
        table = {name: expand(f"Memory.{name}", getattr(self, name), num_stages) for name in names}
        after = self.activation if self.after_input is None else self.after_input
        table["after_input"] = expand("Memory.after_input", after, num_stages)
        for name in ("backward_transient", "input_transient", "weight_transient", "first_transient"):
            value = getattr(self, name)
            default = table["backward_transient"] if name == "first_transient" else table["transient"]
            table[name] = default if value is None else expand(f"Memory.{name}", value, num_stages)
        return table

    def without_transients(self) -> Memory:
        """What the engine's ledger sees: the sizes between computes, without the peaks inside them."""
        return dataclasses.replace(
            self,
            transient=0.0,
            backward_transient=None,
            input_transient=None,
            weight_transient=None,
            first_transient=None,
            reduce_transient=0.0,
            gather_transient=0.0,
        )

    def optimizer_peak(self, placement: tuple[int, ...]) -> list[float]:
        """Per rank, what the optimizer step holds at its peak: the state of its stages and their temporaries."""
        table = self.per_stage(len(placement))
        peaks = [0.0] * (max(placement) + 1)
        for stage, rank in enumerate(placement):
            peaks[rank] += table["state"][stage] + table["optimizer"][stage]
        return peaks


_WHEN = operator.itemgetter(0, 1)  # events by (time, order)
_TRANSIENT = {
    Kind.FORWARD: "transient",
    Kind.BACKWARD: "backward_transient",
    Kind.BACKWARD_INPUT: "input_transient",
    Kind.BACKWARD_WEIGHT: "weight_transient",
}
Sample = tuple[float, float, Action | None]  # (time, bytes held after it, the action that made the change)


def track(schedule: object, times: list[list[tuple[float, float]]], memory: Memory) -> list[list[Sample]]:
    """Each rank's bytes over a simulated step: one sample per change, in time order (at equal times, in
    program order). ``times`` are run()'s (start, end) of every action."""
    tracks = []
    for events in _changes(schedule, times, memory):
        samples: list[Sample] = []
        total = 0.0
        for time, _, delta, cause in events:
            total += delta
            samples.append((time, total, cause))
        tracks.append(samples)
    return tracks


def peaks(schedule: object, times: list[list[tuple[float, float]]], memory: Memory) -> list[float]:
    """Each rank's most bytes over a simulated step: the highest of ``track``'s samples (a search wants only
    these)."""
    return [
        max(accumulate(delta for _, _, delta, _ in events), default=0.0) for events in _changes(schedule, times, memory)
    ]


def _changes(
    schedule: object, times: list[list[tuple[float, float]]], memory: Memory
) -> list[list[tuple[float, int, float, Action | None]]]:
    """Each rank's changes of bytes, (time, order, delta, the action that made it), sorted by (time, order)."""
    S = schedule.num_stages  # type: ignore[attr-defined]
    table = memory.per_stage(S)
    placement = schedule.placement  # type: ignore[attr-defined]
    streams: tuple[tuple[Action, ...], ...] = schedule.instructions  # type: ignore[attr-defined]
    plans, computes = _plan(schedule)
    local = [s > 0 and placement[s - 1] == placement[s] for s in range(S)]  # input handed over on its rank
    sent_at = _sent_at(plans, times, memory.buffered_sends)
    tracks = []
    for rank, (stream, plan) in enumerate(zip(streams, plans, strict=True)):
        mine = [s for s in range(S) if placement[s] == rank]
        extra = _shared_boundaries(computes[rank], times[rank], table, local)  # order -> bytes added at its end
        events = _rank_changes(stream, plan, times[rank], mine, table, memory, local, sent_at, extra)
        events.sort(key=_WHEN)
        tracks.append(events)
    return tracks


def _sent_at(plans: list[list[_Step]], times: list[list[tuple[float, float]]], buffered: bool) -> dict[int, float]:
    """Message key -> when its send completed and its tensors went: buffered, as its rank goes on to its next action
    (done when posted); else when matched (its post's end)."""
    sent_at: dict[int, float] = {}
    for rank, plan in enumerate(plans):
        spans = times[rank]
        for index, step in enumerate(plan):
            if step[1]:
                after = spans[index + 1][0] if index + 1 < len(spans) else spans[index][1]
                for key in step[1]:
                    sent_at[key] = after if buffered else spans[index][1]
    return sent_at


def _rank_changes(
    stream: tuple[Action, ...],
    plan: list[_Step],
    times: list[tuple[float, float]],
    mine: list[int],
    table: dict[str, list[float]],
    memory: Memory,
    local: list[bool],
    sent_at: dict[int, float],
    extra: dict[int, float],
) -> list[tuple[float, int, float, Action | None]]:
    """One rank's changes of bytes, unsorted: its state at time zero, then each action's (the module's docstring)."""
    boundary, gradient, activation = table["boundary"], table["gradient"], table["activation"]
    after_input, gathered, gathered_grads = table["after_input"], table["gathered"], table["gathered_grads"]
    events: list[tuple[float, int, float, Action | None]] = []  # (time, order, delta, action)
    events.append((0.0, -1, sum(table["state"][s] - table["grads_late"][s] for s in mine), None))
    late = {s: table["grads_late"][s] for s in mine if table["grads_late"][s]}
    unmade = set(mine)  # stages whose first B or W is still to come
    ungathered = {s for s in mine if gathered[s]}  # FSDP: no F yet
    sharded = {s for s in mine if gathered_grads[s]}
    grads_made: set[int] = set()
    held: dict[tuple[int, int], float] = {}  # (stage, mb) -> its activation held now on this rank
    for order, ((start, end), (recvs, _, collective, compute)) in enumerate(zip(times, plan, strict=True)):
        action = stream[order]
        for is_gradient, at in recvs:  # a buffer from its post
            events.append((start, order, gradient[at] if is_gradient else boundary[at], action))
        if collective is not None:  # its flat buffers, to the step's end
            is_reduce, s, group = collective
            flat = table["sync"][s] if is_reduce else (memory.tie_sync[group] if group < len(memory.tie_sync) else 0.0)
            if flat:
                events.append((start, order, flat, action))
            if is_reduce and s in sharded:  # FSDP: reduce-scattered, resharded; a unit's reduce-scatter input held
                rise = table["reduce_transient"][s]
                events += [(start, order, rise, action), (end, order, -rise, action)]
                held_after = table["reduce_held"][s] - gathered[s] - gathered_grads[s]
                events.append((end, order, late.pop(s, 0.0) + held_after, action))
        if compute is None:
            continue
        s, mb, kind, needed, made = compute
        if s in ungathered:  # FSDP: the first compute gathers the stage's parameters (into a buffer, copied out)
            ungathered.discard(s)
            rise = table["gather_transient"][s]
            events += [(start, order, gathered[s] + rise, action), (end, order, -rise, action)]
        transient = table[_TRANSIENT[kind]][s]
        if kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT) and s in unmade:
            unmade.discard(s)
            if memory.first_transient is not None:
                transient = table["first_transient"][s]
        if transient:
            events += [(start, order, transient, action), (end, order, -transient, action)]
        delta = 0.0
        if needed is not None:  # the input buffer (received, or handed over) is taken
            is_gradient, at, crosses = needed
            if not is_gradient:
                delta -= boundary[at] if crosses else 0.0
            else:
                delta -= gradient[at]
        if kind is Kind.FORWARD:
            now = activation[s] - (boundary[s - 1] if local[s] else 0.0)
            held[(s, mb)] = now
            delta += now
        elif kind is Kind.BACKWARD_INPUT:
            now = after_input[s] - (boundary[s - 1] if local[s] else 0.0)
            delta += now - held.get((s, mb), 0.0)
            held[(s, mb)] = now
        else:  # B or W: the micro-batch is done on this stage
            delta -= held.pop((s, mb), 0.0)
            if s in sharded:  # FSDP: whole gradients, until the AR reduce-scatters them into the shards
                delta += gathered_grads[s] if s not in grads_made else 0.0
                grads_made.add(s)
            else:
                delta += late.pop(s, 0.0)  # the stage's first gradient compute makes its parameters' gradients
        if made is not None:  # a gradient, for the stage before: held until sent, or until taken here
            at, crosses, key, send = made
            size = gradient[at]
            delta += size  # one change at the compute's end, as a step is seen between instructions
            if crosses:
                events.append((max(end, sent_at.get(key, end)), len(stream), -size, send))
        events.append((end, order, delta + extra.get(order, 0.0), action))
    return events


# per action, what track needs of it whatever the prices: ((gradient, boundary) of each recv it posts, the keys of
# the sends it posts, (is an AR, stage, tie group) of a collective or None, (stage, mb, kind, (gradient, boundary,
# crosses) of the message it takes or None, (boundary, crosses, key, its send) of the gradient it makes or None) of a
# compute or None)
_Compute = tuple[int, int, Kind, tuple[bool, int, bool] | None, tuple[int, bool, int, Instruction] | None]
_Step = tuple[tuple[tuple[bool, int], ...], tuple[int, ...], tuple[bool, int, int] | None, _Compute | None]
_PLANS: ByIdentity[tuple[list[list[_Step]], list[dict[tuple[Kind, int, int], int]]]] = ByIdentity()


def _plan(schedule: object) -> tuple[list[list[_Step]], list[dict[tuple[Kind, int, int], int]]]:
    """Each rank's steps (_Step) and its computes' indices by (kind, stage, mb): made once per schedule, which a search
    prices many times."""
    return _PLANS.get(schedule, lambda: _planned(schedule))


def _planned(schedule: object) -> tuple[list[list[_Step]], list[dict[tuple[Kind, int, int], int]]]:
    flow = Dataflow.of(schedule)
    M = schedule.num_microbatches  # type: ignore[attr-defined]
    plans, computes = [], []
    for stream in schedule.instructions:  # type: ignore[attr-defined]
        plan: list[_Step] = []
        done: dict[tuple[Kind, int, int], int] = {}
        for index, action in enumerate(stream):
            ops = ops_of(action)
            recvs = tuple((m.gradient, m.boundary) for m in (Message.of(op) for op in ops if op.kind.is_recv))
            sends = tuple(Message.of(op).key(M) for op in ops if op.kind.is_send)
            collective = compute = None
            if isinstance(action, Instruction) and action.kind.is_collective:
                is_reduce = action.kind is Kind.ALL_REDUCE
                collective = (is_reduce, action.stage, 0 if is_reduce else action.tie_group)
            elif isinstance(action, Instruction) and action.kind.is_compute:
                done[(action.kind, action.stage, action.microbatch)] = index
                needed, made = flow.consumes(action), flow.produces(action)
                compute = (
                    action.stage,
                    action.microbatch,
                    action.kind,
                    None if needed is None else (needed.gradient, needed.boundary, flow.crosses(needed)),
                    None
                    if made is None or not made.gradient
                    else (made.boundary, flow.crosses(made), flow.key(made), made.send()),
                )
            plan.append((recvs, sends, collective, compute))
        plans.append(plan)
        computes.append(done)
    return plans, computes


def _shared_boundaries(
    done: dict[tuple[Kind, int, int], int],
    times: list[tuple[float, float]],
    table: dict[str, list[float]],
    local: list[bool],
) -> dict[int, float]:
    """For each handed-over boundary tensor that the later stage holds after the earlier one let it go: its
    bytes, added where the earlier stage lets go and taken off where the later one does (by action index).
    ``done``: (kind, stage, mb) -> index of that compute in the rank's stream."""

    def release(stage: int, mb: int, keeps: str) -> int | None:
        if (Kind.BACKWARD, stage, mb) in done:
            return done[(Kind.BACKWARD, stage, mb)]
        if table[keeps][stage] or (Kind.BACKWARD_INPUT, stage, mb) not in done:
            return done.get((Kind.BACKWARD_WEIGHT, stage, mb))
        return done[(Kind.BACKWARD_INPUT, stage, mb)]

    extra: dict[int, float] = {}
    for kind, stage, mb in list(done):
        if kind is not Kind.FORWARD or not local[stage]:
            continue
        earlier = release(stage - 1, mb, "output_after_input")
        later = release(stage, mb, "input_after_input")
        if earlier is None or later is None or times[later][1] <= times[earlier][1]:
            continue
        size = table["boundary"][stage - 1]
        extra[earlier] = extra.get(earlier, 0.0) + size
        extra[later] = extra.get(later, 0.0) - size
    return extra
