"""Validation: prove a schedule's invariants before anything runs.

1. every (stage, micro-batch) is forwarded once and backwarded once (one B, or one I
   and one W), on the rank that hosts the stage, in dependency order; a forward-only
   (inference) schedule has no backward at all;
2. every send has exactly one matching recv and vice versa, each recv comes before the
   compute that needs it and each send after the compute that produces it, and on each
   (sender, receiver) channel recvs are posted in the order of the sends;
3. no deadlock under the transport's semantics. RENDEZVOUS (NCCL): an op (or a post)
   blocks until its partners are posted; in the graph of program order plus matched
   pairs, each pair contracted to one node, a cycle is a deadlock. BUFFERED (gloo, the
   in-process loopback): posting never blocks; a compute waits for the send of the
   message it consumes, and a rank's end for the recvs of its sends;
4. with data parallelism, each stage's gradient all-reduce comes once, after the stage's
   last gradient compute (all-reduces are asynchronous: waited on at the end of the step);
   a group of tied weights that spans ranks is summed once on each of its ranks, after the
   last gradient compute there of any stage of the group.

Which message a compute consumes and produces is schedules.ir.dataflow's; rule 3's replays are
schedules.proof.deadlock's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from schedules.ir.dataflow import Dataflow, Message
from schedules.ir.gcpause import gc_paused
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule, ScheduleError
from schedules.proof.deadlock import Semantics, Where, find_deadlock

__all__ = ["Semantics", "validate", "check_compute", "check_communication", "check_deadlock"]

ABSENT: Where = (-1, -1)  # an instruction that is not in the schedule
F, B, IN, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


@gc_paused()
def validate(schedule: Schedule, semantics: Semantics = Semantics.RENDEZVOUS) -> None:
    """Raise ScheduleError naming the first broken invariant; return None if all hold.

    ``semantics``: what the transport that will run it guarantees (see Semantics); rendezvous,
    the strictest, by default.
    """
    index = _Index.build(schedule)
    _check_order(index)
    _check_messages(index)
    _check_syncs(index)
    _check_ties(index)
    _check_deadlock(index, semantics)


def check_compute(schedule: Schedule) -> None:
    """Rule 1 alone (what a compute-only schedule must satisfy before lowering)."""
    _check_order(_Index.build(schedule))


def check_communication(schedule: Schedule) -> None:
    """Rule 2 alone."""
    _check_messages(_Index.build(schedule))


def check_deadlock(schedule: Schedule, semantics: Semantics = Semantics.RENDEZVOUS) -> None:
    """Rule 3 alone."""
    _check_deadlock(_Index.build(schedule), semantics)


def _check_deadlock(index: _Index, semantics: Semantics) -> None:
    find_deadlock(index.schedule, index.flow, semantics, index.sends, index.recvs)


@dataclass
class _Index:
    """Where every instruction is, built in one pass that also checks ranges, hosts and duplicates."""

    schedule: Schedule
    flow: Dataflow
    compute: dict[Kind, list[Where]]  # kind -> stage*M + mb -> where, or ABSENT
    sends: list[Where]  # message key -> where its send is, or ABSENT
    recvs: list[Where]  # message key -> where its recv is, or ABSENT
    channels: dict[tuple[int, int], tuple[list[int], list[int]]]  # (sender, receiver) -> (sends, recvs) in order
    syncs: dict[int, list[Where]]  # stage -> where its gradient all-reduces are
    ties: dict[int, list[tuple[Where, int]]]  # tie group -> (where, stage) of each of its sums

    @classmethod
    def build(cls, schedule: Schedule) -> _Index:
        S, M, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
        flow = Dataflow.of(schedule)
        compute = {kind: [ABSENT] * (S * M) for kind in (F, B, IN, W)}
        sends, recvs = [ABSENT] * flow.num_keys, [ABSENT] * flow.num_keys
        channels: dict[tuple[int, int], tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        syncs: dict[int, list[Where]] = {}
        ties: dict[int, list[tuple[Where, int]]] = {}
        for rank in range(schedule.num_ranks):
            for at, op in schedule.ops(rank):
                here = (rank, at)
                if not (0 <= op.stage < S and (op.kind.indexes != "micro-batch" or 0 <= op.microbatch < M)):
                    raise schedule.error(
                        "instructions name existing stages and micro-batches",
                        f"rank {rank} instruction {at}: {op} is outside stages 0..{S - 1}, micro-batches 0..{M - 1}",
                        [here],
                    )
                if placement[op.stage] != rank:
                    raise schedule.error(
                        "a stage's instructions run on the rank that hosts it",
                        f"rank {rank} instruction {at}: {op} belongs to stage {op.stage}, "
                        f"hosted on rank {placement[op.stage]}",
                        [here],
                    )
                if op.kind is Kind.TIE_REDUCE:
                    ties.setdefault(op.tie_group, []).append((here, op.stage))
                    continue
                if op.kind.is_collective:
                    syncs.setdefault(op.stage, []).append(here)
                    continue
                if op.kind.is_compute:
                    slots, key = compute[op.kind], op.stage * M + op.microbatch
                else:
                    key = flow.carried_key(op)
                    boundary = (key >> 1) // M
                    peer = boundary + (op.stage == boundary)  # the other stage of the boundary
                    if not 0 <= boundary < S - 1 or placement[peer] == rank:
                        reason = "does not exist" if not 0 <= peer < S else f"is on the same rank {rank}"
                        raise schedule.error(
                            "communication only crosses ranks",
                            f"rank {rank} instruction {at}: {op} talks to stage {peer}, which {reason}",
                            [here],
                        )
                    slots = sends if op.kind.is_send else recvs
                    if op.kind.is_send:
                        channels[(rank, placement[peer])][0].append(key)
                    else:
                        channels[(placement[peer], rank)][1].append(key)
                if slots[key] is not ABSENT:
                    raise schedule.error(
                        "each instruction appears exactly once",
                        f"{op} appears at (rank, instruction) {slots[key]} and {here}",
                        [slots[key], here],
                    )
                slots[key] = here
        return cls(schedule, flow, compute, sends, recvs, dict(channels), syncs, ties)

    def message(self, key: int, send: bool) -> Instruction:
        """The send (or recv) instruction of a message key."""
        message = Message.from_key(key, self.schedule.num_microbatches)
        return message.send() if send else message.recv()


def _check_order(index: _Index) -> None:
    """Rule 1: each stage/micro-batch forwarded and backwarded once, in dependency order on each rank.

    Order is checked within a rank; across ranks it comes from communication (rule 2).
    """
    schedule = index.schedule
    S, M = schedule.num_stages, schedule.num_microbatches
    fwd, full, grad_in, weight = index.compute[F], index.compute[B], index.compute[IN], index.compute[W]

    def fail(rule: str, first: tuple[Kind, int, Where], then: tuple[Kind, int, Where]) -> ScheduleError:
        a, b = (Instruction(key // M, kind, key % M) for kind, key, _ in (first, then))
        (rank, at), (_, earlier) = then[2], first[2]
        return schedule.error(
            rule, f"rank {rank}: {b} at instruction {at} runs before {a} at instruction {earlier}", [first[2], then[2]]
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
    schedule, flow = index.schedule, index.flow
    M, placement = schedule.num_microbatches, schedule.placement
    for key, (send, recv) in enumerate(zip(index.sends, index.recvs, strict=True)):
        if (send is ABSENT) != (recv is ABSENT):
            op = index.message(key, send=send is not ABSENT)
            where = send if send is not ABSENT else recv
            message = Message.from_key(key, M)
            other = message.recv() if op.kind.is_send else message.send()
            raise schedule.error(
                "every send has exactly one matching recv, and every recv one send",
                f"rank {where[0]} instruction {where[1]}: {op} has no matching "
                f"{'recv' if op.kind.is_send else 'send'} {other} on rank {placement[other.stage]}",
                [where],
            )
    used = bytearray(flow.num_keys)  # the messages some compute produces and consumes
    for kind in (F, B, IN):
        for key, here in enumerate(index.compute[kind]):
            if here is ABSENT:
                continue
            rank, at = here
            op = Instruction(key // M, kind, key % M)
            needs, makes = flow.consumed_key(op), flow.produced_key(op)
            needed = Message.from_key(needs, M) if needs >= 0 and flow.crosses_key(needs) else None
            made = Message.from_key(makes, M) if makes >= 0 and flow.crosses_key(makes) else None
            if needed is not None:
                used[flow.key(needed)] = 1
                recv, rule = index.recvs[flow.key(needed)], "a compute's input is received before it runs"
                if recv is ABSENT:
                    raise schedule.error(
                        rule,
                        f"rank {rank} instruction {at}: {op} needs {needed.recv()} before it, and there is none "
                        "(a compute-only schedule must go through schedules.lower first)",
                        [here],
                    )
                if recv[1] >= at:
                    raise schedule.error(
                        rule,
                        f"rank {rank}: {needed.recv()} at instruction {recv[1]} comes after {op} at {at}",
                        [recv, here],
                    )
            if made is not None:
                used[flow.key(made)] = 1
                sent, rule = index.sends[flow.key(made)], "a compute's output is sent after it runs"
                if sent is ABSENT:
                    raise schedule.error(
                        rule,
                        f"rank {rank} instruction {at}: {op} is never sent ({made.send()} is missing; a "
                        "compute-only schedule must go through schedules.lower first)",
                        [here],
                    )
                if sent[1] <= at:
                    raise schedule.error(
                        rule,
                        f"rank {rank}: {made.send()} at instruction {sent[1]} is posted before {op} at {at} "
                        "produces it",
                        [sent, here],
                    )
    for key, send in enumerate(index.sends):
        if send is not ABSENT and not used[key]:
            message = Message.from_key(key, M)
            why = (
                f"boundary {message.boundary} carries no gradient (no_gradient)"
                if message.gradient and message.boundary in flow.no_gradient
                else "no compute of the schedule produces and consumes it"
            )
            raise schedule.error(
                "every message carries what one compute produces and another consumes",
                f"{message.send()} (rank {send[0]} instruction {send[1]}) and {message.recv()}: {why}",
                [send, index.recvs[key]],
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
                f"stage {stage} has {len(where)} all-reduces, at (rank, instruction) {where}",
                where,
            )
        for kind in (B, W):
            last = max(index.compute[kind][stage * M : (stage + 1) * M])
            if last is not ABSENT and last[1] > where[0][1]:
                raise schedule.error(
                    "a stage's gradients are all-reduced after its last gradient compute",
                    f"rank {last[0]}: the all-reduce of stage {stage} at instruction {where[0][1]} comes before a "
                    f"{kind.value} of that stage at instruction {last[1]}",
                    [where[0], last],
                )


def _check_ties(index: _Index) -> None:
    """Each tie group that spans ranks: one sum per rank of it, after that rank's last gradient of the group."""
    schedule, M = index.schedule, index.schedule.num_microbatches
    if all(x is ABSENT for kind in (B, IN, W) for x in index.compute[kind]):
        return  # forward only: no gradient to sum
    for group, where in index.ties.items():
        if not 0 <= group < len(schedule.tied):
            raise schedule.error(
                "a tied-weight sum names a tie group of the schedule",
                f"{schedule.instructions[where[0][0][0]][where[0][0][1]]} names tie group {group}; the schedule has "
                f"{len(schedule.tied)} (schedule.tied)",
                [w for w, _ in where],
            )
    for group, stages in enumerate(schedule.tied):
        ranks = sorted({schedule.placement[s] for s in stages})
        sums = index.ties.get(group, [])
        if len(ranks) == 1:
            continue  # a local tie: one rank holds the weight for all its stages
        by_rank = {rank: [(w, s) for w, s in sums if w[0] == rank] for rank in ranks}
        for rank, mine in by_rank.items():
            if len(mine) != 1 or mine[0][1] not in stages:
                raise schedule.error(
                    "a group of tied weights is summed exactly once on each rank that holds it, at one of its stages",
                    f"tie group {group} (stages {list(stages)}) has {len(mine)} sum(s) on rank {rank}",
                    [w for w, _ in mine],
                )
            ((here, _),) = mine
            for stage in stages:
                if schedule.placement[stage] != rank:
                    continue
                for kind in (B, W):
                    last = max(index.compute[kind][stage * M : (stage + 1) * M])
                    if last is not ABSENT and last[1] > here[1]:
                        raise schedule.error(
                            "tied weights are summed after the last gradient compute that touches them",
                            f"rank {rank}: the sum of tie group {group} at instruction {here[1]} comes before a "
                            f"{kind.value} of stage {stage} at instruction {last[1]}",
                            [here, last],
                        )
