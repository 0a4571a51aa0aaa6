"""Rule 3 of validation: no deadlock under the transport's semantics.

RENDEZVOUS (NCCL): an op (or a post) blocks until its partners are posted; in the graph of
program order plus matched pairs, each pair contracted to one node, a cycle is a deadlock.
BUFFERED (gloo, the in-process loopback): posting never blocks; a compute waits for the send of
the message it consumes, and a rank's end for the recvs of its sends. Either way the streams are
replayed under those rules, and a stuck replay is reported as the cycle of ranks waiting on each
other.
"""

from __future__ import annotations

import enum
from collections import deque

from schedules.ir.dataflow import Dataflow, Message
from schedules.ir.instructions import Instruction, Post, ops_of
from schedules.ir.schedule import Schedule

__all__ = ["Semantics", "find_deadlock"]

Where = tuple[int, int]  # (rank, index of the action in the rank's stream)


class Semantics(enum.Enum):
    """When a posted send or recv holds its rank up: what a transport guarantees."""

    RENDEZVOUS = "rendezvous"  # NCCL: an op (or a post of several) completes only once its partners are posted
    BUFFERED = "buffered"  # gloo, loopback: posting never blocks; a rank waits only for data it consumes


def find_deadlock(
    schedule: Schedule, flow: Dataflow, semantics: Semantics, send_at: list[Where], recv_at: list[Where]
) -> None:
    """Rule 3: replay the streams under the transport's blocking rules; if stuck, print the cycle.

    Under RENDEZVOUS the replay is a topological pass over the rendezvous graph (program order
    on each rank, each message's send and recv contracted to one node): a communication point
    (one op or a post) is posted when the one before it on its rank completes, and completes
    when the partner of each of its ops is posted. Every point completes iff the graph is
    acyclic. Under BUFFERED, posting never blocks: a compute waits until the send of the
    message it consumes is posted, and a rank's stream ends once the recvs of all its sends
    are posted. Either way each stuck rank waits on a rank that has not reached the partner
    op; that wait-for graph holds the deadlock cycle. ``send_at`` and ``recv_at`` say, per
    message key, where its send and its recv are (the report names the partner's place).
    """
    M, placement, p = schedule.num_microbatches, schedule.placement, schedule.num_ranks
    rendezvous = semantics is Semantics.RENDEZVOUS
    # per rank, its blocking points: (index, ((message, is_send, peer rank), ...)) where the rank posts and waits
    Point = tuple[int, tuple[tuple[int, bool, int], ...]]
    points: list[list[Point]] = []
    for rank in range(p):
        mine: list[Point] = []
        sends: list[tuple[int, bool, int]] = []
        for at, action in enumerate(schedule.instructions[rank]):
            if isinstance(action, Post) or not (action.kind.is_compute or action.kind.is_collective):
                # a recv's peer hosts the other stage of the boundary; so does a send's
                ops = [(flow.carried_key(op), op.kind.is_send, placement[_other(op, flow)]) for op in ops_of(action)]
                if rendezvous:
                    mine.append((at, tuple(ops)))
                else:  # posting never blocks (peer -1 marks a posting point); sends are waited for at the end
                    mine.append((at, tuple((key, s, -1) for key, s, _ in ops)))
                    sends += [(key, True, peer) for key, s, peer in ops if s]
            elif not rendezvous and action.kind.is_compute:
                needs = flow.consumed_key(action)
                if needs >= 0 and flow.crosses_key(needs):
                    mine.append((at, ((needs, False, placement[Message.from_key(needs, M).sender]),)))
        if not rendezvous and sends:
            mine.append((len(schedule.instructions[rank]), tuple(sends)))
        points.append(mine)
    if rendezvous:
        stuck = _replay_rendezvous(points, p, flow.num_keys)
    else:
        stuck = _replay_buffered(points, p, flow.num_keys)
    if not stuck:
        return
    posted, pcs = stuck
    from networkx import DiGraph, find_cycle  # only when there is a cycle to show: a third of a second to import

    waits = DiGraph()
    for rank in range(p):
        if pcs[rank] >= len(points[rank]):
            continue
        at, messages = points[rank][pcs[rank]]
        for key, is_send, peer in messages:
            if peer >= 0 and not posted[not is_send][key]:
                waits.add_edge(rank, peer, key=key, is_send=is_send, at=at)
    lines, cells = [], []
    for rank, peer in find_cycle(waits):
        edge = waits.edges[rank, peer]
        key, is_send, at = edge["key"], edge["is_send"], edge["at"]
        theirs = recv_at[key] if is_send else send_at[key]
        stream = schedule.instructions[rank]
        what = str(stream[at]) if at < len(stream) else "the end of its stream"
        lines.append(
            f"  rank {rank} at instruction {at} ({what}) waits for rank {peer} "
            f"to post {_instruction(key, not is_send, M)} at instruction {theirs[1]}"
        )
        cells += [(rank, at), theirs]
    rule = (
        "no deadlock: a send completes only when its recv is posted (rendezvous), and vice versa"
        if rendezvous
        else "no deadlock: a compute waits for the send of what it consumes, a rank's end for its sends' recvs"
    )
    raise schedule.error(rule, "these ranks wait on each other in a cycle:\n" + "\n".join(lines), cells)


def _instruction(key: int, send: bool, num_microbatches: int) -> Instruction:
    """The send (or recv) instruction of a message key."""
    message = Message.from_key(key, num_microbatches)
    return message.send() if send else message.recv()


def _other(op: Instruction, flow: Dataflow) -> int:
    """The stage at the other end of a send or recv: the other stage of its boundary."""
    boundary = (flow.carried_key(op) >> 1) // flow.num_microbatches
    return boundary + (op.stage == boundary)


_Stuck = tuple[tuple[bytearray, bytearray], list[int]] | None  # (posted[is_send][message], pcs) when stuck


def _replay_rendezvous(points: list[list[tuple[int, tuple[tuple[int, bool, int], ...]]]], p: int, keys: int) -> _Stuck:
    posted = (bytearray(keys), bytearray(keys))  # [is_send][message]
    pcs, arrived = [0] * p, [False] * p
    pending = deque(range(p))
    while pending:
        rank = pending.popleft()
        mine = points[rank]
        while pcs[rank] < len(mine):
            _, messages = mine[pcs[rank]]
            if not arrived[rank]:
                arrived[rank] = True
                for key, is_send, peer in messages:
                    posted[is_send][key] = 1
                    pending.append(peer)
            if any(not posted[not is_send][key] for key, is_send, _ in messages):
                break
            pcs[rank], arrived[rank] = pcs[rank] + 1, False
    if all(pcs[rank] >= len(points[rank]) for rank in range(p)):
        return None
    return posted, pcs


def _replay_buffered(points: list[list[tuple[int, tuple[tuple[int, bool, int], ...]]]], p: int, keys: int) -> _Stuck:
    """Points with peer -1 post their ops; the others wait for their partners to have been posted."""
    posted = (bytearray(keys), bytearray(keys))
    pcs = [0] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            mine = points[rank]
            while pcs[rank] < len(mine):
                _, messages = mine[pcs[rank]]
                if messages and messages[0][2] < 0:  # posting: never blocks
                    for key, is_send, _ in messages:
                        posted[is_send][key] = 1
                elif any(not posted[not is_send][key] for key, is_send, _ in messages):
                    break
                pcs[rank] += 1
                progress = True
    if all(pcs[rank] >= len(points[rank]) for rank in range(p)):
        return None
    return posted, pcs
