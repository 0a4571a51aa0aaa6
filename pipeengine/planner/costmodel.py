"""The cost model: a stage's times and bytes (the simulator's Costs) from its layers' measurements.

A LayerProfile (pipeengine.planner.measure) holds, per layer, times (F, B, I, W) and bytes on a micro-batch.
A stage's time is the sum of its layers', plus the machine's host cost per compute and, under tensor
parallelism, the price of each collective its layers ran (pipeengine.planner.calibration). Its bytes are
counted as the engine's memory ledger counts a step (pipeengine.observe.ledger): what one micro-batch holds
from F to B is the stage's input (not the first stage's: the user's batch), its output, what each layer saves
beyond its input and output, and a layer's output inside the stage only if that layer or the next one saves it::

    activation(a..b) = input(a) + sum saved_other(l) + sum out(l) [l or l+1 saves it] + out(b-1)

A split backward's I keeps, until W, everything saved and the gradient arriving at each node with
weights beneath it (measured per layer through pipeengine.step.backward), and lets the stage's output go
unless W needs it (something beneath W's restart points saved it), and what each layer saved for
nodes above them (measured per layer: such tensors are the layer's own); on the first stage, whose
input needs no gradient, W is the whole backward and keeps the received gradient instead. A step's
state (weights, gradients, the optimizer's copies) is schedules.state_bytes of the parameters.

Collectives, as the runtime runs them: tensor parallelism's inside each compute (its time adds to F, and to B
and I, the backward's); the replicas' all-reduce of a stage's gradients (AR) after the stage's last backward,
its gradients flattened into one buffer on the rank (host time: ``Prices.copy`` a byte), then asynchronous, one at
a time on a rank, and copied back at the step's end; with FSDP the AR is FSDP2's reduce-scatter of each unit,
which holds the rank until it is done, and its all-gather of a stage's parameters comes before its first forward
of the step. Each post of messages takes host time (``Prices.post``). A checkpointed stage keeps its input and
output between F and B and runs its forward again in the backward.

Ranks with processors of their own (GPUs) wait on each other through every collective. Ranks that share a
machine's processors (CPU ranks, more than its cores: ``Prices.processors``, measured) are the optional CPU host
model's (pipeengine.planner.shared_cores): they compute slower together than alone, the simulator sharing the
processors among the computes running at each moment, and gloo's tensor-parallel collectives and the replicas'
all-reduce are partly work on the same cores; FSDP's gather waits on other ranks and is not shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pipeengine.parallel.fsdp import priced
from pipeengine.planner import shared_cores, transients
from pipeengine.planner.calibration import Link, Prices
from schedules import Costs, Memory, state_bytes

__all__ = ["FREE", "LayerProfile"]

FREE = Prices(
    0.0,
    Link(0.0, 0.0),
    {},
    "free: no host cost, no message or collective time",
    frame={},
    post=0.0,
    post_message=0.0,
    copy=0.0,
    fsdp={},
)


@dataclass(frozen=True)
class LayerProfile:
    """Per layer, on micro-batches of ``rows`` rows: seconds and bytes."""

    rows: int
    forward: tuple[float, ...]  # seconds, median (zeros where not timed)
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    parameter_bytes: tuple[int, ...]
    parameter_count: tuple[int, ...]  # elements: bytes / count is the dtype's size, whatever it is
    output: tuple[int, ...]  # bytes of the layer's output (the boundary after it)
    gradient: tuple[int, ...]  # bytes of its output's gradient (the floating part)
    saved_other: tuple[int, ...]  # saved for backward beyond the layer's input and output
    saves_input: tuple[bool, ...]
    saves_output: tuple[bool, ...]
    kept: tuple[int, ...]  # what a split backward's I keeps for W (the gradient at each node with weights)
    output_kept: tuple[bool, ...]  # whether the output is still held after I (something W needs saved it)
    other_freed: tuple[int, ...]  # of saved_other, what I lets go (saved by nodes W does not need)
    saved: tuple[int, ...]  # everything the layer saves for its backward (its input and output too), parameters not
    timed: bool = True
    # per layer, (index among the model's parameters, bytes) of each parameter it holds: a weight tied across layers
    # (an embedding and its head) has one index, and a rank that holds it twice holds it once
    parameters: tuple[tuple[tuple[int, int], ...], ...] = ()
    allocations: tuple[transients.Allocation, ...] = ()  # as the allocator saw each layer (where it was watched)
    tensor_parallel: int = 1  # measured as one of this many tensor-parallel ranks runs each layer (its shard)
    # per layer, the collectives its computes ran over the tensor-parallel group: (compute "F" or "B", op, bytes of
    # the whole tensor), as pipeengine.planner.calibration prices them
    collectives: tuple[tuple[tuple[str, str, int], ...], ...] = ()
    # per layer, whether its output under tensor parallelism is a rank's shard of the whole one (ColwiseParallel's, and
    # what follows it until a RowwiseParallel): a stage cannot end there (the engine refuses to send a shard)
    shards_output: tuple[bool, ...] = ()
    # bytes torch's checkpoint stashes per call on the device measured (its RNG state, where that lives in the
    # device's memory: the CPU's, 5056 bytes; a GPU's is kept in host memory)
    checkpoint_stash: int = 0

    def stage_costs(
        self,
        bounds: Sequence[tuple[int, int]],
        *,
        prices: Prices = FREE,
        optimizer_copies: int = 2,
        buffered_sends: bool = True,
        placement: Sequence[int] | None = None,
        data_parallel: int = 1,
        fsdp: bool = False,
        checkpoint: str = "never",
    ) -> Costs:
        """The simulator's Costs (time and memory) for stages of these layers (``bounds``: [start, end) each).

        ``prices``: the host cost per compute, a message across a boundary, each collective (default: all free).
        ``placement`` (stage -> rank): a parameter that several stages of a rank hold (a tied embedding and head,
        both on rank 0 of a V) is that rank's state once, with the first.
        With the allocator's measurements: each compute's transient peak, the gradients made by a stage's first
        B or W (an optimizer's zero_grad sets them to None), the all-reduce's flat buffers (``data_parallel``
        > 1) and the optimizer step over each rank's parameters (AdamW), as the simulator's memory model has them.
        ``fsdp``: the state sharded over the ``data_parallel`` replicas, the parameters gathered whole from a
        stage's first F to its AR and its whole gradients from its first B or W to the AR. ``checkpoint``: the
        engine's option ("never", "always", "except_last").
        """
        checkpointed = [
            checkpoint == "always" or (checkpoint == "except_last" and s != len(bounds) - 1) for s in range(len(bounds))
        ]
        memory, params, boundary = self._memory(
            bounds, placement, optimizer_copies, buffered_sends, data_parallel, fsdp, checkpointed
        )
        world = data_parallel * self.tensor_parallel * (max(placement) + 1 if placement else len(bounds))
        tp_forward = [self._collectives("F", a, b, prices, world) for a, b in bounds]  # (work, wait) each
        tp_backward = [self._collectives("B", a, b, prices, world) for a, b in bounds]
        forward = [_total(self.forward, a, b) + sum(c) for (a, b), c in zip(bounds, tp_forward, strict=True)]
        backward = [_total(self.backward, a, b) + sum(c) for (a, b), c in zip(bounds, tp_backward, strict=True)]
        grad_input = [_total(self.backward_input, a, b) + sum(c) for (a, b), c in zip(bounds, tp_backward, strict=True)]
        forward_wait, backward_wait = [c[1] for c in tp_forward], [c[1] for c in tp_backward]
        weight = [_total(self.backward_weight, a, b) for a, b in bounds]
        # a checkpointed stage runs its forward again in its backward (in I, under a split backward)
        again = [f if c else 0.0 for f, c in zip(forward, checkpointed, strict=True)]
        if fsdp:  # each unit's hooks: in its forward, and in its backward (B or I)
            hooks = [sum(1 for size in self.parameter_bytes[a:b] if size) for a, b in bounds]  # units per stage
            forward_hooks, backward_hooks = prices.fsdp.get("hooks", (0.0, 0.0))
            forward = [f + n * forward_hooks for f, n in zip(forward, hooks, strict=True)]
            backward = [b + n * backward_hooks for b, n in zip(backward, hooks, strict=True)]
            grad_input = [i + n * backward_hooks for i, n in zip(grad_input, hooks, strict=True)]
        reduce, gather, sync_host = self._replicas(bounds, params, prices, data_parallel, fsdp, world)
        return Costs(
            forward=[f + prices.overhead for f in forward],
            backward=[b + a + prices.overhead for b, a in zip(backward, again, strict=True)],
            backward_input=[i + a + prices.overhead for i, a in zip(grad_input, again, strict=True)],
            backward_weight=[w + prices.overhead for w in weight],
            latency=prices.p2p.latency,
            per_byte=prices.p2p.per_byte,
            message_bytes=boundary,
            memory=memory,
            all_reduce=reduce,
            gather=gather,
            processors=shared_cores.per_pipeline(prices.processors, data_parallel, self.tensor_parallel),
            forward_wait=forward_wait,
            backward_wait=backward_wait,
            post=prices.post,
            post_message=prices.post_message,
            sync_host=sync_host,
            sync_blocking=fsdp,
            wake=prices.wake,
            unit="s",
        )

    def _memory(
        self,
        bounds: Sequence[tuple[int, int]],
        placement: Sequence[int] | None,
        optimizer_copies: int,
        buffered_sends: bool,
        data_parallel: int,
        fsdp: bool,
        checkpointed: list[bool],
    ) -> tuple[Memory, list[float], list[float]]:
        """The stages' memory model (stage_costs' docstring says what it holds), each stage's parameter bytes (once
        per rank) and the bytes it sends the next stage."""
        total = _total
        activation, after_input, params, boundary, gradient, keeps_out, keeps_in = [], [], [], [], [], [], []
        for index, (a, b) in enumerate(bounds):
            held = (self.output[a - 1] if a > 0 else 0) + total(self.saved_other, a, b) + self.output[b - 1]
            held += sum(self.output[k] for k in range(a, b - 1) if self.saves_output[k] or self.saves_input[k + 1])
            last = index == len(bounds) - 1
            if a > 0:  # I keeps the gradient arriving at each node with weights, for W; the output goes, unless saved
                kept = total(self.kept, a, b) - total(self.other_freed, a, b)
                kept -= 0 if self.output_kept[b - 1] else self.output[b - 1]  # on the last stage: the loss
            else:  # the first stage's W is its whole backward: it keeps the received gradient instead
                kept = 0 if last else self.gradient[b - 1]
            activation.append(held)
            after_input.append(held + kept)
            keeps_out.append(1.0 if a == 0 or self.output_kept[b - 1] else 0.0)  # the first stage keeps all for W
            keeps_in.append(1.0 if a == 0 or self.saves_input[a] else 0.0)
            params.append(self._state_of(index, bounds, placement))  # each stage's parameter bytes, once per rank
            boundary.append(0.0 if last else float(self.output[b - 1]))
            gradient.append(0.0 if last else float(self.gradient[b - 1]))
        state = [state_bytes(p, optimizer_copies) for p in params]
        memory = Memory(
            state=state,
            activation=activation,
            after_input=after_input,
            boundary=boundary,
            gradient=gradient,
            buffered_sends=buffered_sends,
            output_after_input=keeps_out,
            input_after_input=keeps_in,
        )
        if self.allocations:
            memory = self._allocated(memory, bounds, placement, params, data_parallel, checkpointed)
        if fsdp:  # each stage's state over the replicas, gathered whole during the step
            memory = priced(
                memory,
                state,
                optimizer_copies,
                data_parallel,
                bool(self.allocations),
                self._largest_units(bounds),
                buffered_sends,
            )
        if any(checkpointed):
            memory = _checkpointed(memory, checkpointed, bounds, self.output, self.checkpoint_stash)
        return memory, params, boundary

    def _replicas(
        self,
        bounds: Sequence[tuple[int, int]],
        params: list[float],
        prices: Prices,
        data_parallel: int,
        fsdp: bool,
        world: int,
    ) -> tuple[list[float], list[float], list[float]]:
        """Seconds of each stage's sync over the replicas (its AR), of its gather before its first F, and of the
        host's part of the sync (the copies)."""
        if fsdp:  # the gradients reduce-scattered over the replicas, the parameters all-gathered once a step: one
            # of each per FSDP unit (pipeengine.parallel.fsdp.shard_stage: each layer with parameters), each copying
            # the whole tensors in or out of its flat buffer on the host
            reduce = [self._per_unit("reduce_scatter", a, b, prices, data_parallel) for a, b in bounds]
            gather = [
                self._per_unit("all_gather", a, b, prices, data_parallel) + prices.copy * p
                for (a, b), p in zip(bounds, params, strict=True)
            ]
            return reduce, gather, [prices.copy * p * (1 + 1 / data_parallel) for p in params]
        # flattened at the AR, copied back (and divided) once it is done, at the step's end
        synced = data_parallel > 1
        speed = shared_cores.replicas_speed(prices.processors, world)  # 1 where ranks have processors of their own
        reduce = [
            (prices.collective("all_reduce", data_parallel, p, crowded=True) + 2 * prices.copy * p) * speed * synced
            for p in params
        ]
        return reduce, [0.0] * len(bounds), [prices.copy * p * synced for p in params]

    def _per_unit(self, op: str, a: int, b: int, prices: Prices, data_parallel: int) -> float:
        """Seconds of one FSDP collective per layer of [a, b) that holds parameters, on that layer's bytes, with what
        FSDP2 adds to each."""
        extra = prices.fsdp_extra("gather" if op == "all_gather" else "reduce", data_parallel)
        return sum(
            prices.collective(op, data_parallel, float(size), crowded=True) + extra
            for size in self.parameter_bytes[a:b]
            if size
        )

    def _collectives(self, compute: str, a: int, b: int, prices: Prices, world: int) -> tuple[float, float]:
        """Seconds of the tensor-parallel collectives layers [a, b) run in their forward ("F") or backward ("B"):
        (work, wait): all a wait where ranks have processors of their own, else split by the CPU host model
        (shared_cores.split)."""
        work = wait = 0.0
        for layer in self.collectives[a:b] if self.collectives else ():
            for when, op, size in layer:
                if when != compute:
                    continue
                alone = prices.collective(op, self.tensor_parallel, size)
                crowded = (
                    prices.collective(op, self.tensor_parallel, size, crowded=True)
                    if prices.processors is not None
                    else alone
                )
                more = shared_cores.split(alone, crowded, prices.processors, self.tensor_parallel, world)
                work, wait = work + more[0], wait + more[1]
        return work, wait

    def _allocated(
        self,
        memory: Memory,
        bounds: Sequence[tuple[int, int]],
        placement: Sequence[int] | None,
        params: list[float],
        data_parallel: int,
        checkpointed: Sequence[bool],
    ) -> Memory:
        """The memory model with what the allocator saw: transients, late gradients, sync buffers, the optimizer.
        A checkpointed stage's W is one autograd call (transients.stage's one_pass)."""
        columns: dict[str, list[float]] = {}
        for (a, b), once in zip(bounds, checkpointed, strict=True):
            for name, value in transients.stage(self.allocations, a, b, once).items():
                columns.setdefault(name, []).append(value)
        grads = params  # the stage's parameters (once per rank), as gradients
        ranks = list(placement) if placement is not None else list(range(len(bounds)))
        optimizer = [0.0] * len(bounds)
        for rank in set(ranks):
            mine = [s for s, r in enumerate(ranks) if r == rank]
            layers = [self.allocations[k] for s in mine for k in range(*bounds[s])]
            optimizer[mine[0]] = transients.optimizer(layers)
        return dataclasses.replace(
            memory,
            **columns,  # type: ignore[arg-type]
            grads_late=grads,
            optimizer=optimizer,
            sync=grads if data_parallel > 1 else 0.0,
        )

    def in_flight(self, bounds: Sequence[tuple[int, int]], fsdp: bool = False) -> float:
        """Bytes of the largest tensor these stages send or receive (a boundary) or reduce over the tensor-parallel
        group, or (``fsdp``) reduce-scatter (a unit's gradients): on gloo a transfer's work object may hold its buffer
        past the step's peak, on some ranks and some steps (measured: a dp2 x tp2 step 32 KiB over on one rank of
        four, its allocations the same on all; a dp2 x pp2 FSDP ZB-H1 step one block's gradients over in 1 of 4
        runs), so a rank's peak is priced with one more."""
        boundaries = [float(self.output[b - 1]) for _, b in bounds[:-1]]
        collectives = [float(size) for layer in self.collectives for _, _, size in layer]
        units = self._largest_units(bounds) if fsdp else []
        return max([*boundaries, *collectives, *units], default=0.0)

    def _largest_units(self, bounds: Sequence[tuple[int, int]]) -> list[float]:
        """Each stage's largest FSDP unit (shard_stage's: a layer with parameters), its parameters' bytes."""
        return [float(max(self.parameter_bytes[a:b], default=0)) for a, b in bounds]

    def _state_of(self, stage: int, bounds: Sequence[tuple[int, int]], placement: Sequence[int] | None) -> float:
        """Bytes of a stage's parameters not held by an earlier stage of its rank (each layer's, without ties)."""
        a, b = bounds[stage]
        if not self.parameters:
            return float(sum(self.parameter_bytes[a:b]))
        mine = {key: size for layer in range(a, b) for key, size in self.parameters[layer]}
        if placement is not None:
            for earlier, (c, d) in enumerate(bounds[:stage]):
                if placement[earlier] == placement[stage]:
                    for layer in range(c, d):
                        for key, _ in self.parameters[layer]:
                            mine.pop(key, None)
        return float(sum(mine.values()))


def _total(values: Sequence[float], a: int, b: int) -> float:
    return float(sum(values[a:b]))


def _checkpointed(
    memory: Memory,
    checkpointed: Sequence[bool],
    bounds: Sequence[tuple[int, int]],
    output: Sequence[int],
    stash: int = 0,
) -> Memory:
    """A checkpointed stage holds its input and output from F to B (its I keeps them for W), and what torch's
    checkpoint stashes for the recompute (``stash``: its RNG state, on the CPU); its backward holds again, while it
    recomputes, what the forward saved: the difference rides on B's and I's transients."""
    n = len(bounds)
    table = memory.per_stage(n)
    columns: dict[str, list[float]] = {
        name: list(table[name]) for name in ("activation", "after_input", "backward_transient", "input_transient")
    }
    for s, (a, b) in enumerate(bounds):
        if not checkpointed[s]:
            continue
        ends = float((output[a - 1] if a > 0 else 0) + output[b - 1])
        kept = ends + stash
        saved = max(columns["activation"][s] - ends, 0.0)  # recomputed beside the stash, which stays until B ends
        columns["activation"][s] = kept
        columns["after_input"][s] = kept + max(table["after_input"][s] - table["activation"][s], 0.0)
        columns["backward_transient"][s] += saved
        columns["input_transient"][s] += saved
    return dataclasses.replace(memory, **columns)  # type: ignore[arg-type]
