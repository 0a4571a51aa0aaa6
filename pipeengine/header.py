"""The step header: one all_gather before each step, so every rank knows the batch or refuses it together.

Inputs live on the first stage's rank and targets on the last; the other ranks must
size their receive buffers and, if the batch is bad, raise the same error instead of
waiting for messages that will never come. Each rank contributes one int64 row::

    [status, is_tuple, n_inputs, (dtype, ndim, d0..d7) x 8 inputs, target batch size]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeengine.errors import PeerError
from pipeengine.specs import Boundary, Tensors, TensorSpec, unpack

__all__: list[str] = []

MAX_TENSORS, MAX_DIMS = 8, 8
_FIELDS = 2 + MAX_DIMS  # per input tensor
_ROW = 3 + MAX_TENSORS * _FIELDS + 1
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


class Status(enum.IntEnum):
    OK = 0
    NO_INPUTS = 1
    BAD_INPUTS = 2
    NO_TARGETS = 3
    BAD_TARGETS = 4


_WHY = {
    Status.NO_INPUTS: "the rank of the first stage got no inputs (None): pass the batch's inputs there",
    Status.BAD_INPUTS: "the inputs on the first stage's rank are not usable",
    Status.NO_TARGETS: "the rank of the last stage got no targets (None): pass the targets to train_step there",
    Status.BAD_TARGETS: "the targets on the last stage's rank are not usable",
}


@dataclass(frozen=True)
class Header:
    """What every rank agreed on for this step."""

    batch_size: int
    microbatch_inputs: Boundary  # the first stage's input for one micro-batch


def _encode(inputs: object, targets: object, first: bool, last: bool, train: bool) -> tuple[list[int], str]:
    row = [0] * _ROW
    row[-1] = -1
    if first:
        if inputs is None:
            return _status(row, Status.NO_INPUTS), ""
        tensors, problem = _tensors(inputs, "inputs")
        if not problem and len(tensors) > MAX_TENSORS:
            problem = f"{len(tensors)} input tensors; at most {MAX_TENSORS} are supported"
        for i, tensor in enumerate(tensors if not problem else ()):
            if tensor.dim() == 0 or tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
                problem = f"input {i} is {tensor.dtype} with shape {list(tensor.shape)}; it needs a batch dimension, "
                problem += f"at most {MAX_DIMS} dimensions and one of the dtypes {[str(d) for d in _DTYPES]}"
                break
            base = 3 + i * _FIELDS
            row[base : base + 2 + tensor.dim()] = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        if problem:
            return _status(row, Status.BAD_INPUTS), problem
        row[1], row[2] = int(isinstance(inputs, tuple)), len(tensors)
    if last and train:
        if targets is None:
            return _status(row, Status.NO_TARGETS), ""
        tensors, problem = _tensors(targets, "targets")
        if problem:
            return _status(row, Status.BAD_TARGETS), problem
        row[-1] = tensors[0].shape[0]
    return row, ""


def _status(row: list[int], status: Status) -> list[int]:
    row[0] = int(status)
    return row


def _tensors(value: object, what: str) -> tuple[Tensors, str]:
    """The tensors of a batch value, or why it is not usable."""
    if isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value)
    ):
        tensors = unpack(value)
        sizes = {t.shape[0] if t.dim() else None for t in tensors}
        if len(sizes) != 1 or None in sizes:
            shapes = [list(t.shape) for t in tensors]
            return (), f"the {what} must all share their first (batch) dimension, got shapes {shapes}"
        return tensors, ""
    return (), f"the {what} are {type(value).__name__}; pass a tensor or a tuple of tensors"


def exchange(
    inputs: object,
    targets: object,
    *,
    first: bool,
    last: bool,
    train: bool,
    num_microbatches: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> Header:
    """All-gather the header rows; every rank returns the same Header or raises the same ValueError."""
    mine, detail = _encode(inputs, targets, first, last, train)
    world = dist.get_world_size(group)
    rows = [torch.empty(_ROW, dtype=torch.int64, device=device) for _ in range(world)]
    try:
        dist.all_gather(rows, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    except Exception as error:
        rank = dist.get_rank(group)
        raise PeerError(f"rank {rank}: waiting for the other ranks to start the step failed: {error}") from error
    table = [row.tolist() for row in rows]
    for rank, row in enumerate(table):
        if row[0] != Status.OK:
            reason = _WHY[Status(row[0])] + (f": {detail}" if rank == dist.get_rank(group) and detail else "")
            raise ValueError(f"step refused by rank {rank}: {reason}")
    source = next(row for row in table if row[2] > 0)
    specs = []
    for i in range(source[2]):
        base = 3 + i * _FIELDS
        dtype, ndim = _DTYPES[source[base]], source[base + 1]
        specs.append(TensorSpec(tuple(source[base + 2 : base + 2 + ndim]), dtype, False))
    batch = specs[0].shape[0]
    m = num_microbatches
    if batch % m:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"a batch of {batch} does not split into {m} equal micro-batches: use a batch size that is a multiple "
            f"of {m} (e.g. {batch - batch % m or m} or {batch - batch % m + m}), or num_microbatches in {divisors}"
        )
    target_batch = next((row[-1] for row in table if row[-1] >= 0), None)
    if train and target_batch != batch:
        raise ValueError(f"the targets have {target_batch} rows but the inputs {batch}: they must match")
    per_microbatch = tuple(TensorSpec((batch // m, *s.shape[1:]), s.dtype, False) for s in specs)
    return Header(batch, Boundary(per_microbatch, bool(source[1])))
