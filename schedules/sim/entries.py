"""Each rank's stream as the simulator's hot loops read it: a skeleton made once per schedule, priced per costs.

An entry is an ``Entry`` (a NamedTuple read by name: in the hot loops no slower than a tuple's indexing):

    compute        (kind, stage*M + mb, its price, message it needs or -1, whether that crosses ranks,
                    message it makes or -1, (), 0.0, of its price the seconds it waits on other ranks)
    communication  (None, 0, 0.0, -1, False, -1, ((message key, is_send), ...), host seconds to post it, 0.0)
    collective     (None, stage, its price, -1, False, -1, (), host seconds to start it, its price if it holds the
                    rank until done (blocking) else 0.0)

``host`` is rank time that takes a processor (posting: buffers, the calls that issue the transfers; a gradient
sync: flattening the gradients); ``hold`` keeps the rank without a processor (a tensor-parallel collective inside a
compute, FSDP's gather, a blocking reduce-scatter). A compute's price includes its hold.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from schedules.ir.dataflow import Dataflow
from schedules.ir.instructions import Instruction, Kind, Post, ops_of
from schedules.ir.schedule import Schedule
from schedules.sim.memo import ByIdentity

__all__ = ["Charges", "Entry", "Skeleton"]


class Entry(NamedTuple):
    """One step of a rank's priced program (the module's docstring: a compute, a communication, a collective)."""

    kind: Kind | None  # None: communication or a collective
    slot: int  # a compute's stage * M + micro-batch; a collective's stage
    price: float
    needs: int  # the message a compute needs, or -1
    crosses: bool  # whether that message crosses ranks
    makes: int  # the message a compute makes, or -1
    keys: tuple[tuple[int, bool], ...]  # a communication's (message key, is_send)
    host: float  # rank time that takes a processor
    hold: float  # of the price, what keeps the rank without a processor (or a blocking collective's price)


class Skeleton(NamedTuple):
    """One action of a rank's stream, whatever the prices: a compute, a communication, or a collective."""

    kind: Kind | None
    stage: int
    slot: int  # a compute's stage * M + micro-batch; a collective's 1 for an AR else 0
    needs: int
    crosses: bool
    makes: int
    extra: bool | tuple[tuple[int, bool], ...]  # a compute: its stage's first F on the rank; a post: its keys


_SKELETONS: ByIdentity[tuple[list[list[Skeleton]], list[bool]]] = ByIdentity()


def skeletons(schedule: Schedule, flow: Dataflow) -> tuple[list[list[Skeleton]], list[bool]]:
    """Each rank's stream flattened for the hot loop, and which messages are received (by a recv): made once per
    schedule, which a search prices many times."""
    return _SKELETONS.get(schedule, lambda: _flattened(schedule, flow))


def _flattened(schedule: Schedule, flow: Dataflow) -> tuple[list[list[Skeleton]], list[bool]]:
    M = flow.num_microbatches
    has_recv = [False] * flow.num_keys
    found = []
    for stream in schedule.instructions:
        skeleton: list[Skeleton] = []
        gathered: set[int] = set()
        for action in stream:
            if isinstance(action, Instruction) and action.kind.is_collective:
                skeleton.append(Skeleton(None, action.stage, int(action.kind is Kind.ALL_REDUCE), -1, False, -1, ()))
            elif isinstance(action, Post) or not action.kind.is_compute:
                keys = tuple((flow.carried_key(op), op.kind.is_send) for op in ops_of(action))
                for key, is_send in keys:
                    if not is_send:
                        has_recv[key] = True
                skeleton.append(Skeleton(None, 0, 0, -1, False, -1, keys))
            else:
                first = action.kind is Kind.FORWARD and action.stage not in gathered
                if first:
                    gathered.add(action.stage)
                needs = flow.consumed_key(action)
                skeleton.append(
                    Skeleton(
                        action.kind,
                        action.stage,
                        action.stage * M + action.microbatch,
                        needs,
                        needs >= 0 and flow.crosses_key(needs),
                        flow.produced_key(action),
                        first,
                    )
                )
        found.append(skeleton)
    return found, has_recv


def priced(
    skeleton: list[Skeleton],
    table: dict[Kind, list[float]],
    durations: Iterator[float] | None,
    charges: Charges,
) -> list[Entry]:
    """A rank's skeleton with its prices (``durations``: its computes' measured times in place of ``table``'s, no
    waits). A gradient sync (AR) carries its price and host time (a TR is free); a stage's first forward on the rank
    carries its gather, which waits on other ranks. ``charges``: what simulation._charges expanded per stage."""
    reduce, gather, waits, post, per_message, sync_host, blocking = charges
    program: list[Entry] = []
    for kind, stage, index, needs, crosses, makes, extra in skeleton:
        if kind is None:
            if not index:  # a post, or a TR
                host = post + per_message * len(extra) if extra else 0.0  # type: ignore[arg-type]
                program.append(Entry(None, stage, 0.0, -1, False, -1, extra, host, 0.0))  # type: ignore[arg-type]
            else:  # an AR
                cost = reduce[stage] if reduce else 0.0
                program.append(
                    Entry(
                        None,
                        stage,
                        cost,
                        -1,
                        False,
                        -1,
                        (),
                        sync_host[stage] if sync_host else 0.0,
                        cost if blocking else 0.0,
                    )
                )
            continue
        if durations is not None:
            program.append(Entry(kind, index, next(durations), needs, crosses, makes, (), 0.0, 0.0))
            continue
        cost, wait = table[kind][stage], waits[kind][stage] if waits else 0.0
        if extra and gather:
            cost += gather[stage]
            wait += gather[stage]
        program.append(Entry(kind, index, cost, needs, crosses, makes, (), 0.0, wait))
    return program


class Charges(NamedTuple):
    """What priced() charges beyond the compute table."""

    reduce: Sequence[float]  # per stage, the AR's price
    gather: Sequence[float]  # per stage, the first F's gather
    waits: dict[Kind, list[float]]  # per kind and stage, the seconds a compute waits on other ranks
    post: float  # a post's host seconds
    per_message: float  # and those per message in it
    sync_host: Sequence[float]  # per stage, an AR's host seconds
    blocking: bool  # whether an AR holds its rank until it is done
