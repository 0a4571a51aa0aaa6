"""The engine's calls (Call: train_step, eval_step, save, load, clip_grad_norm_, export) and the header agreed before
each: one all_gather before every collective call of the engine, so the ranks agree or refuse together.

Every rank says what it is calling (train_step, eval_step, save, load, clip_grad_norm_) and
how many calls it has made; ranks that disagree raise the same error naming each rank's call,
instead of waiting for messages that will never come. For a step, inputs live on the first
stage's rank and targets on the last: the others learn the batch's shapes to size their
receive buffers, and a bad batch is refused by every rank. Each rank contributes one row::

    [call, number, status, is_tuple, n_inputs, (dtype, ndim, d0..d7) x 8 inputs, target batch size]
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from pipeengine.comm.base import Transport
from pipeengine.core.specs import Boundary, Tensors, TensorSpec, unpack
from pipeengine.errors import PipelineError

__all__ = ["BATCH", "N_INPUTS", "ROW", "STATUS"]

_T = TypeVar("_T")

MAX_TENSORS, MAX_DIMS = 8, 8
_FIELDS = 2 + MAX_DIMS  # per input tensor
_HEAD = 5  # call, number, status, is_tuple, n_inputs
_ROW = _HEAD + MAX_TENSORS * _FIELDS + 1
ROW = _ROW  # int64s in the header row each rank gathers before a call (the planner times the gather)
STATUS, N_INPUTS, BATCH = 2, 4, _HEAD + 2  # a row's status, its count of inputs, its first input's batch (d0)
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


class Call(enum.IntEnum):
    """What a rank is doing; the value goes in its header row."""

    TRAIN = 1
    EVAL = 2
    SAVE = 3
    LOAD = 4
    CLIP = 5
    EXPORT = 6
    SAVE_BACKGROUND = 7  # its writes' own group joins at the commit: ranks saving either way would never meet

    def __str__(self) -> str:
        names = {
            1: "train_step",
            2: "eval_step",
            3: "save",
            4: "load",
            5: "clip_grad_norm_",
            6: "full_state_dict",
            7: "save(background=True)",
        }
        return names[self.value]


class Status(enum.IntEnum):
    OK = 0
    NO_INPUTS = 1
    BAD_INPUTS = 2
    NO_TARGETS = 3
    BAD_TARGETS = 4
    NO_GRAD = 5


_WHY = {
    Status.NO_INPUTS: "the rank of the first stage got no inputs (None): pass the batch's inputs there",
    Status.BAD_INPUTS: "the inputs on the first stage's rank are not usable",
    Status.NO_TARGETS: "the rank of the last stage got no targets (None): pass the targets to train_step there",
    Status.BAD_TARGETS: "the targets on the last stage's rank are not usable",
    Status.NO_GRAD: "train_step ran under torch.inference_mode(), where nothing can compute a gradient: "
    "use eval_step for inference, or call train_step outside inference_mode",
}


class CallMismatch(PipelineError):
    """The ranks of a pipeline called different things (or a different number of times)."""


@dataclass(frozen=True)
class Header:
    """What every rank agreed on for a step."""

    batch_size: int
    microbatch_inputs: Boundary  # the first stage's input for one micro-batch


class Calls:
    """An engine's collective calls, counted: each one starts with the header every rank of the pipeline exchanges.

    Where the world holds more than this pipeline (replicas, tensor-parallel ranks), the header rows are gathered
    over the world instead, in the same one collective a call: every rank reads its own pipeline's rows for the
    header, and every pipeline's for the verdict. A refusal seen by one replica alone (its batch was empty) is raised
    on every rank of the world, instead of the other replicas going on to a gradient all-reduce that the refusing
    one never joins. ``pipelines``: the world ranks of each pipeline, in stage order (the grid's pp groups)."""

    def __init__(
        self, transport: Transport, world: Transport | None = None, pipelines: list[list[int]] | None = None
    ) -> None:
        self.transport, self.made = transport, 0
        self.world = world if world is not None and world.size > transport.size else None
        if self.world is not None and pipelines is None:
            raise ValueError("Calls over a world wider than its pipeline needs the world ranks of each pipeline")
        self.pipelines = pipelines or []

    def agree(self, call: Call) -> None:
        """save, load, clip_grad_norm_, full_state_dict: every rank is making the same call, or every rank raises
        CallMismatch."""
        self.made += 1
        if self.world is not None:
            self._world(call, [0] * _ROW, "", lambda table: None)
            return
        agree(call, self.made, self.transport)

    def exchange(
        self, call: Call, inputs: object, targets: object, *, first: bool, last: bool, num_microbatches: int
    ) -> Header:
        """train_step, eval_step: every rank learns the batch (or refuses it, together)."""
        self.made += 1
        if self.world is None:
            return exchange(
                call,
                self.made,
                inputs,
                targets,
                first=first,
                last=last,
                num_microbatches=num_microbatches,
                transport=self.transport,
            )
        mine, detail = _encode(inputs, targets, first, last, call is Call.TRAIN)
        return self._world(call, mine, detail, lambda table: _decode(call, table, num_microbatches))

    def _world(self, call: Call, row: list[int], detail: str, decode: Callable[[list[list[int]]], _T]) -> _T:
        """The header rows of every rank of the world in one all_gather: the world agrees on the call; each
        pipeline's rows give its verdict (refused by a rank's status or by its batch), raised on every rank (a
        pipeline's own error on its ranks, the first refusing pipeline's on the others); else this pipeline's
        ``decode``."""
        world = self.world
        if world is None:  # only called where the world is wider than the pipeline
            raise RuntimeError("Calls._world without a world wider than the pipeline")
        row[0], row[1] = int(call), self.made
        rows = world.gather_header(
            torch.tensor(row, dtype=torch.int64, device=world.control_device),
            f"waiting for the other ranks to start {call} (call {self.made})",
        )
        table = [r.tolist() for r in rows]
        if any(r[:2] != table[0][:2] for r in table):
            calls = ", ".join(f"rank {rank} called {Call(r[0])} (call {r[1]})" for rank, r in enumerate(table))
            raise CallMismatch(
                f"the ranks of the world are not making the same call: {calls}; every rank of every "
                "replica must call train_step, eval_step, save, load and clip_grad_norm_ together, "
                "in the same order"
            )
        details = (
            world.all_gather_object(detail, "the reason the step was refused")
            if any(r[2] != Status.OK for r in table)
            else None
        )
        verdicts: list[tuple[int, BaseException | None, object]] = []  # (first world rank, error, decoded) each
        for ranks in self.pipelines:
            own = [table[r] for r in ranks]
            try:
                _refuse(own, [details[r] for r in ranks] if details is not None else [])
                verdicts.append((min(ranks), None, decode(own)))
            except ValueError as refusal:
                verdicts.append((min(ranks), refusal, None))
        mine = next(v for ranks, v in zip(self.pipelines, verdicts, strict=True) if world.rank in ranks)
        if mine[1] is not None:
            raise mine[1]
        failed = [v for v in verdicts if v[1] is not None]
        if failed:
            first, theirs, _ = min(failed, key=lambda v: v[0])
            raise ValueError(f"{call} refused on rank {first} (another replica or tensor-parallel rank): {theirs}")
        return mine[2]  # type: ignore[return-value]


def agree(call: Call, number: int, transport: Transport) -> None:
    """Every rank of the group is making the same call (save, load, clip); else every one raises CallMismatch."""
    _gather(call, number, [0] * _ROW, "", transport)


def exchange(
    call: Call,
    number: int,
    inputs: object,
    targets: object,
    *,
    first: bool,
    last: bool,
    num_microbatches: int,
    transport: Transport,
) -> Header:
    """All-gather the header rows of a step; every rank returns the same Header or raises the same error."""
    mine, detail = _encode(inputs, targets, first, last, call is Call.TRAIN)
    return _decode(call, _gather(call, number, mine, detail, transport), num_microbatches)


def _decode(call: Call, table: list[list[int]], num_microbatches: int) -> Header:
    """A pipeline's header rows as the step's Header, or the ValueError every rank of it raises alike."""
    source = next(row for row in table if row[4] > 0)
    specs = []
    for i in range(source[4]):
        base = _HEAD + i * _FIELDS
        dtype, ndim = _DTYPES[source[base]], source[base + 1]
        specs.append(TensorSpec(tuple(source[base + 2 : base + 2 + ndim]), dtype, False))
    batch = specs[0].shape[0]
    m = num_microbatches
    if batch == 0:  # every rank sees it in the table: refused together
        shapes = " and ".join(str(list(spec.shape)) for spec in specs)
        raise ValueError(
            f"{call} got an empty batch: the inputs have shape {shapes} (0 rows); pass a batch of at least "
            f"num_microbatches={m} rows (a multiple of {m}), or skip the step on every rank when there is no data"
        )
    if batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        options = sorted({n for n in (batch - batch % m, batch - batch % m + m) if n > 0})
        raise ValueError(
            f"a batch of {batch} does not split into {m} equal micro-batches: use a batch size that is a multiple "
            f"of {m} (e.g. {' or '.join(map(str, options))}), or num_microbatches in {divisors}"
        )
    target_batch = next((row[-1] for row in table if row[-1] >= 0), None)
    if call is Call.TRAIN and target_batch != batch:
        raise ValueError(f"the targets have {target_batch} rows but the inputs {batch}: they must match")
    per_microbatch = tuple(TensorSpec((batch // m, *s.shape[1:]), s.dtype, False) for s in specs)
    return Header(batch, Boundary(per_microbatch, bool(source[3])))


def _gather(call: Call, number: int, row: list[int], detail: str, transport: Transport) -> list[list[int]]:
    row[0], row[1] = int(call), number
    rows = transport.gather_header(
        torch.tensor(row, dtype=torch.int64, device=transport.control_device),
        f"waiting for the other ranks to start {call} (call {number})",
    )
    table = [r.tolist() for r in rows]
    if any((r[0], r[1]) != (row[0], row[1]) for r in table):
        calls = ", ".join(f"rank {rank} called {Call(r[0])} (call {r[1]})" for rank, r in enumerate(table))
        raise CallMismatch(
            f"the ranks of the pipeline are not making the same call: {calls}; every rank must call train_step, "
            "eval_step, save, load and clip_grad_norm_ together, in the same order"
        )
    if any(r[2] != Status.OK for r in table):  # every rank learns why, and raises the same error
        _refuse(table, transport.all_gather_object(detail, "the reason the step was refused"))
    return table


def _refuse(table: list[list[int]], details: list[str]) -> None:
    """Raise the refusal of a pipeline's first rank whose status is not OK (its ``details``, by the table's rank,
    said after the reason), if any."""
    refused = next(((rank, row) for rank, row in enumerate(table) if row[2] != Status.OK), None)
    if refused is not None:
        rank, row = refused
        reason = _WHY[Status(row[2])] + (f": {details[rank]}" if details and details[rank] else "")
        raise ValueError(f"step refused by rank {rank}: {reason}")


def _encode(inputs: object, targets: object, first: bool, last: bool, train: bool) -> tuple[list[int], str]:
    row = [0] * _ROW
    row[-1] = -1
    if train and torch.is_inference_mode_enabled():
        return _status(row, Status.NO_GRAD), ""
    if first:
        if inputs is None:
            return _status(row, Status.NO_INPUTS), ""
        tensors, problem = _tensors(inputs, "inputs")
        if not problem and len(tensors) > MAX_TENSORS:
            problem = f"{len(tensors)} input tensors; at most {MAX_TENSORS} are supported"
        for i, tensor in enumerate(tensors if not problem else ()):
            if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
                problem = f"input {i} is {tensor.dtype} with shape {list(tensor.shape)}; it needs "
                problem += f"at most {MAX_DIMS} dimensions and one of the dtypes {[str(d) for d in _DTYPES]}"
                break
            base = _HEAD + i * _FIELDS
            row[base : base + 2 + tensor.dim()] = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        if problem:
            return _status(row, Status.BAD_INPUTS), problem
        row[3], row[4] = int(isinstance(inputs, tuple)), len(tensors)
    if last and train:
        if targets is None:
            return _status(row, Status.NO_TARGETS), ""
        tensors, problem = _tensors(targets, "targets")
        if problem:
            return _status(row, Status.BAD_TARGETS), problem
        row[-1] = tensors[0].shape[0]
    return row, ""


def _status(row: list[int], status: Status) -> list[int]:
    row[2] = int(status)
    return row


def _tensors(value: object, what: str) -> tuple[Tensors, str]:
    """The tensors of a batch value, or why it is not usable."""
    if isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value)
    ):
        tensors = unpack(value)
        scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
        if scalars:
            return (), (
                f"the {what} need a batch dimension: {what} tensor {scalars[0]} is 0-d (a scalar); "
                "pass a batch of rows, e.g. value.unsqueeze(0) for one"
            )
        sizes = {t.shape[0] for t in tensors}
        if len(sizes) != 1:
            shapes = [list(t.shape) for t in tensors]
            return (), f"the {what} must all share their first (batch) dimension, got shapes {shapes}"
        return tensors, ""
    return (), f"the {what} are {type(value).__name__}; pass a tensor or a tuple of tensors"
