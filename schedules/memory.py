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
    transient    extra bytes while one of the stage's computes runs (its temporaries)

A sent gradient is freed when the send completes: when posted where the transport takes the
bytes at once (``buffered_sends``: gloo, the in-process loopback), else once its recv is
posted too (NCCL's rendezvous).

A handed-over input (the previous stage on the same rank) is that stage's output, already
counted: the later stage's activation holds it once. At unit sizes (activation 1, all else 0)
a rank's peak is the most micro-batches it holds, as published: GPipe m on every rank, 1F1B
p - i on rank i, ZB-H1 p at most, ZB-V about 1F1B's peak on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedules.dataflow import Dataflow, Message
from schedules.instructions import Action, Instruction, Kind, ops_of
from schedules.perstage import PerStage, expand

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
    buffered_sends: bool = False

    def per_stage(self, num_stages: int) -> dict[str, list[float]]:
        names = ("state", "activation", "boundary", "gradient", "transient")
        table = {name: expand(f"Memory.{name}", getattr(self, name), num_stages) for name in names}
        after = self.activation if self.after_input is None else self.after_input
        table["after_input"] = expand("Memory.after_input", after, num_stages)
        return table


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
    sent_at: dict[int, float] = {}  # message key -> when its send completed
    for rank, stream in enumerate(streams):
        for action, (start, end) in zip(stream, times[rank], strict=True):
            for op in ops_of(action):
                if op.kind.is_send:
                    sent_at[Message.of(op).key(M)] = start if memory.buffered_sends else end
    tracks = []
    for rank, stream in enumerate(streams):
        events: list[tuple[float, int, float, Action | None]] = []  # (time, order, delta, action)
        state = sum(table["state"][s] for s in range(S) if placement[s] == rank)
        events.append((0.0, -1, state, None))
        held: dict[tuple[int, int], float] = {}  # (stage, mb) -> its activation held now on this rank
        for order, (action, (start, end)) in enumerate(zip(stream, times[rank], strict=True)):
            for op in ops_of(action):
                if op.kind.is_recv:  # a buffer from its post
                    message = Message.of(op)
                    size = table["gradient" if message.gradient else "boundary"][message.boundary]
                    events.append((start, order, size, action))
            if not (isinstance(action, Instruction) and action.kind.is_compute):
                continue
            s, mb, kind = action.stage, action.microbatch, action.kind
            if table["transient"][s]:
                events += [(start, order, table["transient"][s], action), (end, order, -table["transient"][s], action)]
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
            made = flow.produces(action)
            if made is not None and made.gradient:  # for the stage before: held until sent, or until taken here
                size = table["gradient"][made.boundary]
                delta += size  # one change at the compute's end, as a step is seen between instructions
                if flow.crosses(made):
                    events.append((max(end, sent_at.get(flow.key(made), end)), len(stream), -size, made.send()))
            events.append((end, order, delta, action))
        events.sort(key=lambda e: (e[0], e[1]))
        samples: list[Sample] = []
        total = 0.0
        for time, _, delta, cause in events:
            total += delta
            samples.append((time, total, cause))
        tracks.append(samples)
    return tracks
