"""The step's loss as one process has it: a mean per micro-batch, or a sum over units (tokens) with loss_count.

With ``loss_count``, ``loss_fn`` returns a micro-batch's SUM over its units and the engine divides
by the step's global count (every micro-batch, every replica). A loss_fn that returns a mean
would train silently wrong (each micro-batch's mean divided by the count again), so the first
step checks it once, on the last stage's rank: a sum doubles when its micro-batch is repeated
twice over, a mean does not::

    loss_fn(out, y)                    -> 3.2
    loss_fn(cat(out, out), cat(y, y))  -> 6.4   a sum: right      3.2: a mean, refused on every rank

The count and the check run on the last stage's rank; a failure there (a count that is not a
number, a mean) is raised on every rank of the world (pipeengine.comm.consensus).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from pipeengine.comm.consensus import raise_together
from pipeengine.comm.topology import Topology
from pipeengine.core.specs import Boundary, map_tensors, unpack

__all__: list[str] = []

LossCount = Callable[[object], object]


def units(value: object) -> float:
    """What loss_count returned, as a count: an int, a float or a one-element tensor, finite and >= 0."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        count = float(value.item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        count = float(value)
    else:
        shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]
        raise TypeError(
            f"loss_count(target) must return the number of units (e.g. tokens) in a micro-batch's target: an int, a "
            f"float or a one-element tensor, e.g. (target != -100).sum(); it returned {type(value).__name__} {shown}"
        )
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"loss_count(target) must return a finite count >= 0, it returned {count}")
    return count


def check_summed(loss_fn: Callable[..., torch.Tensor], output: Boundary, target: object, device: torch.device) -> None:
    """Refuse a loss_fn that is not a sum over its micro-batch (see the module docstring); silent if it cannot tell
    (a loss that fails on a doubled batch, or is 0 on this one)."""
    draw = torch.Generator().manual_seed(0)
    made = output.pack(
        [
            torch.randn(s.shape, generator=draw).to(device, s.dtype)
            if s.dtype.is_floating_point
            else torch.zeros(s.shape, dtype=s.dtype, device=device)
            for s in output.specs
        ]
    )
    if not all(isinstance(t, torch.Tensor) for t in unpack(target)):  # type: ignore[arg-type]
        return
    twice = map_tensors(target, lambda t: torch.cat([t, t]))  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            once = float(loss_fn(made, target))
            doubled = float(loss_fn(map_tensors(made, lambda t: torch.cat([t, t])), twice))
    except Exception:  # noqa: BLE001  (a loss that cannot take two copies of its batch: nothing to tell)
        return
    if not math.isfinite(once) or not math.isfinite(doubled) or once == 0:
        return
    ratio = doubled / once
    if abs(ratio - 2) > 1e-3:
        kind = "a mean (the same for the batch twice over)" if abs(ratio - 1) < 1e-3 else f"{ratio:.3g}x, not 2x"
        raise ValueError(
            f"with loss_count=, loss_fn must return the SUM of the loss over a micro-batch's units (the engine divides "
            f"by the step's count), but on a micro-batch and on that micro-batch repeated twice it returned {once:.6g} "
            f"and {doubled:.6g}: {kind}. Return the sum, e.g. F.cross_entropy(..., reduction='sum'), or drop "
            "loss_count to average a mean loss over micro-batches"
        )


def count_units(
    loss_count: LossCount,
    targets: Sequence[object] | None,
    topology: Topology,
    last_rank: int,
    check: tuple[Callable[..., torch.Tensor], Boundary] | None,
) -> float:
    """The step's units over every micro-batch and replica, the same on every rank; a failure raises on every rank.

    ``targets``: this replica's micro-batches, on the last stage's rank (``last_rank`` in the pipeline).
    ``check``: (loss_fn, the last stage's output) to run check_summed on the micro-batch with the most units.
    """
    if topology.pipeline.alone:  # a dry run's rank: meta targets have shapes, no values to count
        return 1.0
    device = topology.pipeline.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    failure: Exception | None = None
    if topology.pipeline.rank == last_rank:
        try:
            counts = [units(loss_count(target)) for target in targets or ()]
            if check is not None and counts and max(counts) > 0:
                check_summed(*check, targets[counts.index(max(counts))], device)  # type: ignore[index]
            total.fill_(sum(counts))
        except Exception as error:  # every rank must hear of it: NaN travels to all
            failure = error
            total.fill_(math.nan)
        if topology.data is not None:
            topology.data.all_reduce(total, "the units counted by the other data-parallel replicas")
    topology.pipeline.broadcast(total, last_rank, f"the step's count of units from rank {last_rank}")
    value = float(total)
    if math.isnan(value):  # some last stage failed: every rank of the world raises, the failing one its own error
        raise_together(failure, topology.world, "the error of loss_count on the last stages")
    if value == 0:
        where = "every micro-batch of every replica" if topology.data_parallel > 1 else "every micro-batch"
        raise ValueError(
            f"loss_count counted 0 units in {where}: a loss averaged over no tokens (every target ignored) is "
            "undefined; skip this batch, or check the padding of the targets"
        )
    return value
