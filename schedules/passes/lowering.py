"""Lowering: the one pass that adds sends and receives to a compute-only schedule.

Where each op goes (t = time in the unit-cost simulation of the compute order)::

    rank q   ... [producer] |SF|  ...                        send: right after its producer, at t_send
    rank r   ... [c_g-1] |gap g| [c_g] ... |gap j| [consumer]   recv: first gap g with time(g) >= t_send,
                                                                and never after the gap j before its consumer

Posting a recv earlier would only wait for a send that has not happened; posting it
later would delay the transfer. One exception: a recv that would follow weight-gradient
passes (W) goes before them. A W neither consumes nor produces a message, so the rank's
order of sends and recvs stays the same, and the transfer runs beside the W instead of
after it. Unit-cost timing puts such a recv after the W (the send ends as the W does);
with a W cheaper than a forward, or messages that take time, the sender is ahead and each
F would wait one message time more per step: ZB-H1's steady state ``I SB W RF F`` is
lowered ``I SB+RF W F``, as Qi et al. (2024) time it (their ZB-H1 bubble, from the timing
script of sail-sg/zero-bubble-pipeline-parallelism, is held by
tests/schedules/test_paper_bubbles.py). All ops in one gap go out as one Post, so the
steady state of 1F1B posts send-activation with recv-gradient, and send-gradient with
recv-activation, together. On every (sender, receiver) channel, recvs are posted in the
order of the sends, as NCCL matches point-to-point messages in order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

from schedules.ir.dataflow import Dataflow
from schedules.ir.gcpause import gc_paused
from schedules.ir.instructions import Action, Instruction, Kind, Post, ops_of
from schedules.ir.schedule import Schedule
from schedules.proof.validation import check_compute
from schedules.sim.simulation import Costs, run

__all__ = ["lower", "lowered", "receives_first"]


def lowered(schedule: Schedule) -> Schedule:
    """The streams to run: a schedule holding compute only (a compiler's output, a hand-written compute order in a
    schedule file) lowered, one with its communication as it is (the engine and ``python -m schedules`` alike)."""
    if schedule.num_ranks > 1 and schedule.compute_only() == schedule:
        return lower(schedule)
    return schedule


@gc_paused()
def lower(schedule: Schedule) -> Schedule:
    """Insert the communication of a compute-only schedule and group what is posted together."""
    compute = schedule.compute_only()
    check_compute(compute)
    flow = Dataflow.of(compute)
    orders = [[op for op in stream if isinstance(op, Instruction)] for stream in compute.instructions]
    p = compute.num_ranks
    ends: list[list[float]] = [[] for _ in range(p)]  # per rank, end of each compute in program order
    for rank, times in enumerate(run(compute, Costs())):
        ends[rank] = [end for _, end in times]

    # sends: right after their producer; sent[message key] = (time, rank) orders each channel
    sends: list[dict[int, Instruction]] = [{} for _ in range(p)]  # rank -> gap -> send
    sent: dict[int, tuple[float, int]] = {}
    for rank, order in enumerate(orders):
        for index, op in enumerate(order):
            made = flow.produces(op)
            if made is not None and flow.crosses(made):
                sends[rank][index + 1] = made.send()
                sent[flow.key(made)] = (ends[rank][index], rank)

    # recvs: the first gap reached at or after the send, at the latest the gap before the consumer, and before the W
    # passes that end there
    channels: dict[tuple[int, int], list[tuple[float, int, int, Instruction]]] = defaultdict(list)
    for rank, order in enumerate(orders):
        gap_times = [0.0] + ends[rank]  # gap g is reached when compute g-1 ends
        for index, op in enumerate(order):
            needed = flow.consumes(op)
            if needed is None or not flow.crosses(needed):
                continue
            time, sender = sent[flow.key(needed)]
            channels[(sender, rank)].append((time, min(bisect_left(gap_times, time), index), rank, needed.recv()))
    recvs: list[dict[int, list[tuple[float, Instruction]]]] = [defaultdict(list) for _ in range(p)]
    before_weights = [_before_weights(order) for order in orders]
    for messages in channels.values():
        messages.sort(key=lambda item: item[0])  # the order of the sends on this channel
        latest = len(ends[messages[0][2]])
        for time, gap, rank, recv in reversed(messages):  # never after a recv of a later send
            latest = min(gap, latest)
            recvs[rank][before_weights[rank][latest]].append((time, recv))  # monotone: the channel keeps its order

    streams = []
    for rank, stream in enumerate(compute.instructions):
        lowered: list[Action] = []
        for gap in range(len(stream) + 1):
            ops = [sends[rank][gap]] if gap in sends[rank] else []
            if gap in recvs[rank]:
                ops += [recv for _, recv in sorted(recvs[rank][gap], key=lambda item: item[0])]
            lowered += _posted(ops)
            if gap < len(stream):
                lowered.append(stream[gap])
        streams.append(lowered)
    return compute.with_streams(streams)


def receives_first(schedule: Schedule) -> Schedule:
    """Every rank posts all its recvs of the step at once, before anything else, in stream order.

    For a transport where posting never blocks and each message is matched on its own, by
    peer and posting order (gloo). There a recv posted early costs only its buffer, while one
    posted mid-step, as the peer sends, contends with the transport's I/O thread for the
    connection (posting took several times longer so: docs/benchmarks.md). Not for NCCL, whose
    point-to-point ops run in order on one stream: a recv posted first holds back the sends
    behind it, which is why ``validate`` refuses the result under rendezvous semantics and proves
    it under buffered ones (gloo's).

    Each channel keeps the order of its recvs, so each still meets its send in order; sends
    and computes stay where they were. Every micro-batch's recv buffers exist from the start.
    """
    streams = []
    for stream in schedule.instructions:
        recvs = [op for action in stream for op in ops_of(action) if op.kind.is_recv]
        actions = _posted(recvs)
        for action in stream:  # the rest, in place
            actions += _posted([op for op in ops_of(action) if not op.kind.is_recv])
        streams.append(actions)
    return schedule.with_streams(streams)


def _before_weights(order: list[Instruction]) -> list[int]:
    """Per gap of a rank's compute order, the gap before the W passes that end there (itself if none)."""
    gaps = list(range(len(order) + 1))
    for gap in range(1, len(order) + 1):
        if order[gap - 1].kind is Kind.BACKWARD_WEIGHT:
            gaps[gap] = gaps[gap - 1]
    return gaps


def _posted(ops: list[Instruction]) -> list[Action]:
    """Ops posted together, as stream actions: none, the one instruction, or a Post of them."""
    return [Post(tuple(ops))] if len(ops) > 1 else list(ops)
