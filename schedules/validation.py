"""Validation: prove a schedule's invariants before anything runs.

1. every (stage, micro-batch) is forwarded once and backwarded once (one B, or one I
   and one W), on the rank that hosts the stage, in dependency order; a forward-only
   (inference) schedule has no backward at all;
2. every send has exactly one matching recv and vice versa, each recv comes before the
   compute that needs it and each send after the compute that produces it, and on each
   (sender, receiver) channel recvs are posted in the order of the sends;
3. no deadlock under rendezvous semantics: an op (or a batch) blocks until its partners
   are posted. In the graph of program order plus matched pairs, each pair contracted
   to one node, a cycle is a deadlock;
4. with data parallelism, each stage's gradient all-reduce comes once, after the stage's
   last gradient compute (all-reduces are asynchronous: waited on at the end of the step).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import networkx as nx

from schedules.gcpause import gc_paused
from schedules.instructions import Batch, Instruction, Kind, message_key, ops_of
from schedules.schedule import Schedule, ScheduleError

__all__ = ["validate", "check_compute", "check_communication", "check_deadlock"]

Where = tuple[int, int]  # (rank, step)
ABSENT: Where = (-1, -1)  # an instruction that is not in the schedule
F, B, IN, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


@gc_paused()
def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first broken invariant; return None if all hold."""
    index = _Index.build(schedule)
    _check_order(index)
    _check_messages(index)
    _check_syncs(index)
    _check_deadlock(index)


def check_compute(schedule: Schedule) -> None:
    """Rule 1 alone (what a compute-only schedule must satisfy before lowering)."""
    _check_order(_Index.build(schedule))


def check_communication(schedule: Schedule) -> None:
    """Rule 2 alone."""
    _check_messages(_Index.build(schedule))


def check_deadlock(schedule: Schedule) -> None:
    """Rule 3 alone."""
    _check_deadlock(_Index.build(schedule))


@dataclass
class _Index:
    """Where every instruction is, built in one pass that also checks ranges, hosts and duplicates."""

    schedule: Schedule
    compute: dict[Kind, list[Where]]  # kind -> stage*M + mb -> where, or ABSENT
    sends: list[Where]  # message key -> where its send is, or ABSENT
    recvs: list[Where]  # message key -> where its recv is, or ABSENT
    channels: dict[tuple[int, int], tuple[list[int], list[int]]]  # (sender, receiver) -> (sends, recvs) in order
    syncs: dict[int, list[Where]]  # stage -> where its gradient all-reduces are

    @classmethod
    def build(cls, schedule: Schedule) -> _Index:
        S, M, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
        compute = {kind: [ABSENT] * (S * M) for kind in (F, B, IN, W)}
        sends, recvs = [ABSENT] * (2 * S * M), [ABSENT] * (2 * S * M)
        channels: dict[tuple[int, int], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        syncs: dict[int, list[Where]] = {}
        for rank in range(schedule.num_ranks):
            for step, op in schedule.ops(rank):
                here = (rank, step)
                if not (0 <= op.stage < S and 0 <= op.microbatch < M):
                    raise schedule.error(
                        "instructions name existing stages and micro-batches",
                        f"rank {rank} step {step}: {op} is outside stages 0..{S - 1}, micro-batches 0..{M - 1}",
                        [here],
                    )
                if placement[op.stage] != rank:
                    raise schedule.error(
                        "a stage's instructions run on the rank that hosts it",
                        f"rank {rank} step {step}: {op} belongs to stage {op.stage}, "
                        f"hosted on rank {placement[op.stage]}",
                        [here],
                    )
                if op.kind.is_collective:
                    syncs.setdefault(op.stage, []).append(here)
                    continue
                if op.kind.is_compute:
                    slots, key = compute[op.kind], op.stage * M + op.microbatch
                else:
                    peer = op.peer_stage
                    if not 0 <= peer < S or placement[peer] == rank:
                        reason = "does not exist" if not 0 <= peer < S else f"is on the same rank {rank}"
                        raise schedule.error(
                            "communication only crosses ranks",
                            f"rank {rank} step {step}: {op} talks to stage {peer}, which {reason}",
                            [here],
                        )
                    slots, key = (sends if op.kind.is_send else recvs), message_key(op, M)
                    if op.kind.is_send:
                        channels[(rank, placement[peer])][0].append(key)
                    else:
                        channels[(placement[peer], rank)][1].append(key)
                if slots[key] is not ABSENT:
                    raise schedule.error(
                        "each instruction appears exactly once",
                        f"{op} appears at (rank, step) {slots[key]} and {here}",
                        [slots[key], here],
                    )
                slots[key] = here
        return cls(schedule, compute, sends, recvs, dict(channels), syncs)

    def message(self, key: int, send: bool) -> Instruction:
        """The send (or recv) instruction of a message key."""
        boundary, mb = divmod(key >> 1, self.schedule.num_microbatches)
        if key & 1:  # a gradient goes from stage boundary+1 to stage boundary
            return (
                Instruction(boundary + 1, Kind.SEND_GRADIENT, mb)
                if send
                else Instruction(boundary, Kind.RECV_GRADIENT, mb)
            )
        return (
            Instruction(boundary, Kind.SEND_ACTIVATION, mb)
            if send
            else Instruction(boundary + 1, Kind.RECV_ACTIVATION, mb)
        )


def _check_order(index: _Index) -> None:
    """Rule 1: each stage/micro-batch forwarded and backwarded once, in dependency order on each rank.

    Order is checked within a rank; across ranks it comes from communication (rule 2).
    """
    schedule = index.schedule
    S, M = schedule.num_stages, schedule.num_microbatches
    fwd, full, grad_in, weight = index.compute[F], index.compute[B], index.compute[IN], index.compute[W]

    def fail(rule: str, first: tuple[Kind, int, Where], then: tuple[Kind, int, Where]) -> ScheduleError:
        a, b = (Instruction(key // M, kind, key % M) for kind, key, _ in (first, then))
        (rank, step), (_, earlier) = then[2], first[2]
        return schedule.error(
            rule, f"rank {rank}: {b} at step {step} runs before {a} at step {earlier}", [first[2], then[2]]
        )

    if all(x is ABSENT for slots in (full, grad_in, weight) for x in slots):  # forward-only (inference)
        for key in range(S * M):
            f = fwd[key]
            if f is ABSENT:
                raise schedule.error(
                    "every (stage, micro-batch) is forwarded",
                    f"missing {key // M}F{key % M} on rank {schedule.placement[key // M]}",
                )
            after = fwd[key + M] if key + M < S * M else ABSENT
            if after[0] == f[0] and after[1] < f[1]:
                raise fail("forward of stage s runs before forward of stage s+1", (F, key, f), (F, key + M, after))
        return
    for key in range(S * M):
        f, b, i, w = fwd[key], full[key], grad_in[key], weight[key]
        if f is ABSENT or (b is ABSENT and (i is ABSENT or w is ABSENT)):
            stage, mb = divmod(key, M)
            missing = [f"{stage}F{mb}"] if f is ABSENT else []
            if b is ABSENT and (i is ABSENT or w is ABSENT):
                missing.append(f"{stage}B{mb} (or both {stage}I{mb} and {stage}W{mb})")
            raise schedule.error(
                "every (stage, micro-batch) is forwarded and backwarded",
                f"missing {', '.join(missing)} on rank {schedule.placement[stage]}",
            )
        if b is not ABSENT and (i is not ABSENT or w is not ABSENT):
            stage, mb = divmod(key, M)
            raise schedule.error(
                "a backward is either full (B) or split (I then W), not both",
                f"stage {stage} micro-batch {mb} has {stage}B{mb} and a split backward",
                [x for x in (b, i, w) if x is not ABSENT],
            )
        grad, grad_kind = (b, B) if b is not ABSENT else (i, IN)
        if grad[0] == f[0] and grad[1] < f[1]:
            raise fail("a stage's forward runs before its backward", (F, key, f), (grad_kind, key, grad))
        if w is not ABSENT and w[0] == i[0] and w[1] < i[1]:
            raise fail("the input gradient (I) runs before the weight gradient (W)", (IN, key, i), (W, key, w))
        if key + M < S * M:  # not the last stage
            after = fwd[key + M]
            if after[0] == f[0] and after[1] < f[1]:
                raise fail("forward of stage s runs before forward of stage s+1", (F, key, f), (F, key + M, after))
            upstream, upstream_kind = (full[key + M], B) if full[key + M] is not ABSENT else (grad_in[key + M], IN)
            if upstream[0] == grad[0] and grad[1] < upstream[1]:
                raise fail(
                    "backward of stage s+1 runs before backward of stage s",
                    (upstream_kind, key + M, upstream),
                    (grad_kind, key, grad),
                )


def _check_messages(index: _Index) -> None:
    """Rule 2: sends and recvs matched one to one, after producers and before consumers, FIFO per channel."""
    schedule = index.schedule
    M, placement, last = schedule.num_microbatches, schedule.placement, schedule.num_stages - 1
    for key, (send, recv) in enumerate(zip(index.sends, index.recvs, strict=True)):
        if (send is ABSENT) != (recv is ABSENT):
            op = index.message(key, send=send is not ABSENT)
            where = send if send is not ABSENT else recv
            raise schedule.error(
                "every send has exactly one matching recv, and every recv one send",
                f"rank {where[0]} step {where[1]}: {op} has no matching {'recv' if op.kind.is_send else 'send'} "
                f"{op.peer()} on rank {placement[op.peer_stage]}",
                [where],
            )
    for kind in (F, B, IN):
        for key, here in enumerate(index.compute[kind]):
            if here is ABSENT:
                continue
            stage, mb = divmod(key, M)
            rank, step = here
            # the message this compute receives before it runs, and the one it sends after
            if kind is F:
                needs = ((key - M) << 1) if stage > 0 and placement[stage - 1] != rank else None
                gives = (key << 1) if stage < last and placement[stage + 1] != rank else None
            else:
                needs = (key << 1 | 1) if stage < last and placement[stage + 1] != rank else None
                gives = ((key - M) << 1 | 1) if stage > 0 and placement[stage - 1] != rank else None
            if needs is not None:
                recv, rule = index.recvs[needs], "a compute's input is received before it runs"
                if recv is ABSENT:
                    raise schedule.error(
                        rule,
                        f"rank {rank} step {step}: {Instruction(stage, kind, mb)} needs "
                        f"{index.message(needs, send=False)} before it, and there is none "
                        "(a compute-only schedule must go through schedules.lower first)",
                        [here],
                    )
                if recv[1] >= step:
                    raise schedule.error(
                        rule,
                        f"rank {rank}: {index.message(needs, send=False)} at step {recv[1]} comes after "
                        f"{Instruction(stage, kind, mb)} at step {step}",
                        [recv, here],
                    )
            if gives is not None:
                sent, rule = index.sends[gives], "a compute's output is sent after it runs"
                if sent is ABSENT:
                    raise schedule.error(
                        rule,
                        f"rank {rank} step {step}: {Instruction(stage, kind, mb)} is never sent "
                        f"({index.message(gives, send=True)} is missing; a compute-only schedule must go "
                        "through schedules.lower first)",
                        [here],
                    )
                if sent[1] <= step:
                    raise schedule.error(
                        rule,
                        f"rank {rank}: {index.message(gives, send=True)} at step {sent[1]} is posted before "
                        f"{Instruction(stage, kind, mb)} at step {step} produces it",
                        [sent, here],
                    )
    for (src, dst), (sent_keys, recv_keys) in index.channels.items():
        if sent_keys != recv_keys:  # same messages (matched above), so same length: find the first swap
            n = next(i for i, (a, b) in enumerate(zip(sent_keys, recv_keys, strict=True)) if a != b)
            raise schedule.error(
                "messages on a channel are received in the order they are sent (NCCL matches them in order)",
                f"rank {src} -> rank {dst}: message {n} sent is {index.message(sent_keys[n], send=True)}, but the "
                f"recv posted in position {n} on rank {dst} is {index.message(recv_keys[n], send=False)}",
                [index.sends[sent_keys[n]], index.recvs[recv_keys[n]]],
            )


def _check_syncs(index: _Index) -> None:
    """Gradient all-reduces (data parallel): none at all, or one per stage after its last gradient compute."""
    schedule, M = index.schedule, index.schedule.num_microbatches
    if not index.syncs:
        return
    for stage in range(schedule.num_stages):
        where = index.syncs.get(stage, [])
        if len(where) != 1:
            raise schedule.error(
                "with gradient sync, every stage all-reduces its gradients exactly once",
                f"stage {stage} has {len(where)} all-reduces, at (rank, step) {where}",
                where,
            )
        for kind in (B, W):
            last = max(index.compute[kind][stage * M : (stage + 1) * M])
            if last is not ABSENT and last[1] > where[0][1]:
                raise schedule.error(
                    "a stage's gradients are all-reduced after its last gradient compute",
                    f"rank {last[0]}: the all-reduce of stage {stage} at step {where[0][1]} comes before a "
                    f"{kind.value} of that stage at step {last[1]}",
                    [where[0], last],
                )


def _check_deadlock(index: _Index) -> None:
    """Rule 3: replay the streams under blocking semantics; if it gets stuck, print the cycle.

    The replay is a topological pass over the rendezvous graph (program order on each
    rank, each message's send and recv contracted to one node): a communication point
    (one op or a batch) is posted when the one before it on its rank completes, and
    completes when the partner of each of its ops is posted. Every point completes
    iff the graph is acyclic. Otherwise each stuck rank waits on a rank that has not
    reached the partner op; that wait-for graph (networkx) holds the deadlock cycle.
    """
    schedule = index.schedule
    M, placement, p = schedule.num_microbatches, schedule.placement, schedule.num_ranks
    Point = tuple[int, tuple[tuple[int, bool, int], ...]]  # (step, ((message, is_send, peer rank), ...))
    points: list[list[Point]] = []
    for rank in range(p):
        mine: list[Point] = []
        for step, action in enumerate(schedule.instructions[rank]):
            if isinstance(action, Batch) or not (action.kind.is_compute or action.kind.is_collective):
                ops = ops_of(action)
                mine.append(
                    (step, tuple((message_key(op, M), op.kind.is_send, placement[op.peer_stage]) for op in ops))
                )
        points.append(mine)
    posted = (bytearray(len(index.sends)), bytearray(len(index.sends)))  # [is_send][message]
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
    stuck = [rank for rank in range(p) if pcs[rank] < len(points[rank])]
    if not stuck:
        return

    waits = nx.DiGraph()
    for rank in stuck:
        step, messages = points[rank][pcs[rank]]
        for key, is_send, peer in messages:
            if not posted[not is_send][key]:
                waits.add_edge(rank, peer, key=key, is_send=is_send, step=step)
    lines, cells = [], []
    for rank, peer in nx.find_cycle(waits):
        edge = waits.edges[rank, peer]
        key, is_send, step = edge["key"], edge["is_send"], edge["step"]
        theirs = index.recvs[key] if is_send else index.sends[key]
        lines.append(
            f"  rank {rank} at step {step} ({schedule.instructions[rank][step]}) waits for rank {peer} "
            f"to post {index.message(key, send=not is_send)} at step {theirs[1]}"
        )
        cells += [(rank, step), theirs]
    raise schedule.error(
        "no deadlock: a send completes only when its recv is posted (rendezvous), and vice versa",
        "these ranks wait on each other in a cycle:\n" + "\n".join(lines),
        cells,
    )
