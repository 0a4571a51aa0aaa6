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
from dataclasses import dataclass

from schedules.ir.dataflow import Dataflow, Message
from schedules.ir.instructions import Action, Instruction, Kind, ops_of
from schedules.sim.perstage import PerStage, expand

__all__ = ["Memory", "state_bytes", "track"]

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
    output_after_input: PerStage = 1.0  # 1: a split backward's I leaves the stage's output held until W; 0: lets go
    input_after_input: PerStage = 1.0  # the same for the stage's input
    buffered_sends: bool = False

    def per_stage(self, num_stages: int) -> dict[str, list[float]]:
        names = ("state", "activation", "boundary", "gradient", "transient", "output_after_input", "input_after_input",
                 "sync", "optimizer", "grads_late", "gathered", "gathered_grads")  # fmt: skip
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
        return dataclasses.replace(self, transient=0.0, backward_transient=None, input_transient=None,
                                   weight_transient=None, first_transient=None)  # fmt: skip

    def optimizer_peak(self, placement: tuple[int, ...]) -> list[float]:
        """Per rank, what the optimizer step holds at its peak: the state of its stages and their temporaries."""
        table = self.per_stage(len(placement))
        peaks = [0.0] * (max(placement) + 1)
        for stage, rank in enumerate(placement):
            peaks[rank] += table["state"][stage] + table["optimizer"][stage]
        return peaks


_TRANSIENT = {Kind.FORWARD: "transient", Kind.BACKWARD: "backward_transient", Kind.BACKWARD_INPUT: "input_transient",
              Kind.BACKWARD_WEIGHT: "weight_transient"}  # fmt: skip
Sample = tuple[float, float, Action | None]  # (time, bytes held after it, the action that made the change)


def track(schedule: object, times: list[list[tuple[float, float]]], memory: Memory) -> list[list[Sample]]:
    """Each rank's bytes over a simulated step: one sample per change, in time order (at equal times, in
    program order). ``times`` are run()'s (start, end) of every action."""
    S, M = schedule.num_stages, schedule.num_microbatches  # type: ignore[attr-defined]
    table = memory.per_stage(S)
    flow = Dataflow.of(schedule)
    placement = schedule.placement  # type: ignore[attr-defined]
    streams: tuple[tuple[Action, ...], ...] = schedule.instructions  # type: ignore[attr-defined]
    local = [s > 0 and placement[s - 1] == placement[s] for s in range(S)]  # input handed over on its rank
    sent_at: dict[int, float] = {}  # message key -> when its send completed and its tensors went
    for rank, stream in enumerate(streams):
        for index, (action, (_, end)) in enumerate(zip(stream, times[rank], strict=True)):
            # buffered: done when posted, let go as the rank goes on to its next action; else when matched
            after = times[rank][index + 1][0] if index + 1 < len(stream) else end
            for op in ops_of(action):
                if op.kind.is_send:
                    sent_at[Message.of(op).key(M)] = after if memory.buffered_sends else end
    tracks = []
    for rank, stream in enumerate(streams):
        extra = _shared_boundaries(stream, times[rank], table, local)  # order -> bytes to add at that action's end
        events: list[tuple[float, int, float, Action | None]] = []  # (time, order, delta, action)
        state = sum(table["state"][s] - table["grads_late"][s] for s in range(S) if placement[s] == rank)
        events.append((0.0, -1, state, None))
        late = {s: table["grads_late"][s] for s in range(S) if placement[s] == rank and table["grads_late"][s]}
        unmade = {s for s in range(S) if placement[s] == rank}  # stages whose first B or W is still to come
        ungathered = {s for s in range(S) if placement[s] == rank and table["gathered"][s]}  # FSDP: no F yet
        sharded = {s for s in range(S) if placement[s] == rank and table["gathered_grads"][s]}
        grads_made: set[int] = set()
        held: dict[tuple[int, int], float] = {}  # (stage, mb) -> its activation held now on this rank
        for order, (action, (start, end)) in enumerate(zip(stream, times[rank], strict=True)):
            for op in ops_of(action):
                if op.kind.is_recv:  # a buffer from its post
                    message = Message.of(op)
                    size = table["gradient" if message.gradient else "boundary"][message.boundary]
                    events.append((start, order, size, action))
            if isinstance(action, Instruction) and action.kind.is_collective:  # its flat buffers, to the step's end
                flat = table["sync"][action.stage] if action.kind is Kind.ALL_REDUCE else (
                    memory.tie_sync[action.tie_group] if action.tie_group < len(memory.tie_sync) else 0.0)  # fmt: skip
                if flat:
                    events.append((start, order, flat, action))
                if action.kind is Kind.ALL_REDUCE and action.stage in sharded:  # FSDP: reduce-scattered, resharded
                    s = action.stage
                    freed = table["gathered"][s] + table["gathered_grads"][s]
                    events.append((end, order, late.pop(s, 0.0) - freed, action))
            if not (isinstance(action, Instruction) and action.kind.is_compute):
                continue
            s, mb, kind = action.stage, action.microbatch, action.kind
            if s in ungathered:  # FSDP: the first compute gathers the stage's parameters
                ungathered.discard(s)
                events.append((start, order, table["gathered"][s], action))
            transient = table[_TRANSIENT[kind]][s]
            if kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT) and s in unmade:
                unmade.discard(s)
                if memory.first_transient is not None:
                    transient = table["first_transient"][s]
            if transient:
                events += [(start, order, transient, action), (end, order, -transient, action)]
            delta = 0.0
            needed = flow.consumes(action)
            if needed is not None:  # the input buffer (received, or handed over) is taken
                if not needed.gradient:
                    delta -= table["boundary"][needed.boundary] if flow.crosses(needed) else 0.0
                else:
                    delta -= table["gradient"][needed.boundary]
            if kind is Kind.FORWARD:
                now = table["activation"][s] - (table["boundary"][s - 1] if local[s] else 0.0)
                held[(s, mb)] = now
                delta += now
            elif kind is Kind.BACKWARD_INPUT:
                now = table["after_input"][s] - (table["boundary"][s - 1] if local[s] else 0.0)
                delta += now - held.get((s, mb), 0.0)
                held[(s, mb)] = now
            else:  # B or W: the micro-batch is done on this stage
                delta -= held.pop((s, mb), 0.0)
                if s in sharded:  # FSDP: whole gradients, until the AR reduce-scatters them into the shards
                    delta += table["gathered_grads"][s] if s not in grads_made else 0.0
                    grads_made.add(s)
                else:
                    delta += late.pop(s, 0.0)  # the stage's first gradient compute makes its parameters' gradients
            made = flow.produces(action)
            if made is not None and made.gradient:  # for the stage before: held until sent, or until taken here
                size = table["gradient"][made.boundary]
                delta += size  # one change at the compute's end, as a step is seen between instructions
                if flow.crosses(made):
                    events.append((max(end, sent_at.get(flow.key(made), end)), len(stream), -size, made.send()))
            events.append((end, order, delta + extra.get(order, 0.0), action))
        events.sort(key=lambda e: (e[0], e[1]))
        samples: list[Sample] = []
        total = 0.0
        for time, _, delta, cause in events:
            total += delta
            samples.append((time, total, cause))
        tracks.append(samples)
    return tracks


def _shared_boundaries(
    stream: tuple[Action, ...], times: list[tuple[float, float]], table: dict[str, list[float]], local: list[bool]
) -> dict[int, float]:
    """For each handed-over boundary tensor that the later stage holds after the earlier one let it go: its
    bytes, added where the earlier stage lets go and taken off where the later one does (by action index)."""
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, mb) -> index of that compute in the stream
    for index, action in enumerate(stream):
        if isinstance(action, Instruction) and action.kind.is_compute:
            done[(action.kind, action.stage, action.microbatch)] = index

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
