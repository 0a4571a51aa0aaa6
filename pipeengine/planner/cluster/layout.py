"""One layout of a transformer on a cluster, priced from a hardware description: step time, throughput, memory.

A layout is (tp, pp, dp, micro-batch, micro-batch count, schedule, chunks, recomputation), tensor parallelism
innermost, as Megatron-LM lays ranks out. The price comes from three sources, none measured on the target:

- each block's computes, traced on the meta device at the tensor-parallel rank's own shapes
  (pipeengine.planner.cluster.costs), priced per operation as a roofline: a matmul at the device's peak times its
  measured matmul efficiency, anything at the device's memory bandwidth, whichever is longer;
- each collective at the bus bandwidth of the link tier its group spans (pipeengine.planner.cluster.collectives):
  tensor parallelism's two all-reduces per block per forward (and per backward, and per recomputed forward, as
  Megatron-LM's RowParallel/ColumnParallel layers make them), the pipeline's messages between nodes (each rank
  sends 1/t of an activation and the t ranks all-gather it, Megatron-LM's scatter/gather; an exchange holds both
  ranks until it is done, as Megatron-LM's p2p_communication waits and synchronizes after batch_isend_irecv), the
  replicas' gradient all-reduce after the last backward (``Runtime``: pipeengine's AR and Megatron-LM's 2021 "local"
  data parallelism wait for it; torch's DistributedDataParallel overlaps it with the last backward, bucket by bucket);
- the pipeline's bubble from the schedule itself: the simulator replays the schedule (schedules.sim) with the
  stages' forward and backward times and the messages' times.

The embedding's lookups (and their backward) run on the first stage; the final norm, the head and the loss on the
last. Each micro-batch's backward after the first adds its weight gradients into the kept ones (autograd's
AccumulateGrad, and Megatron-LM 2021's hooks, each read both and write one: ``Runtime.accumulate_bytes`` a parameter,
memory-bound), unless the runtime fuses it into the weight-gradient matmul. The step also pays the optimizer (read
and written once: memory-bound). Memory per device: weights, gradients and
Adam's state as mixed precision keeps them (2 + 2 + 4 + 4 + 4 bytes a parameter: fp16 weight and gradient, fp32
master, two fp32 moments; under FSDP the 12 bytes of master and moments are divided among the replicas, and the whole
fp16 weights and gradients are held through the step, as pipeengine's FSDP2 stages gather once a step), and
activations: with full recomputation each block keeps its input per micro-batch in
flight (1F1B keeps up to pp of them on the first stage), plus one block's whole activations while it is recomputed.

One pricing path: ``price`` ranks what the search keeps (after ``estimate``, the bubble from its formula and the
memory from the same model, pruned the rest) and prices a user's fixed layout, so a layout costs the same however it
was found; ``check`` refuses a fixed layout the search would never build.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pipeengine.planner.cluster import collectives
from pipeengine.planner.cluster.costs import Op
from pipeengine.planner.cluster.hardware import Hardware

__all__ = [
    "PIPEENGINE",
    "Layout",
    "Model",
    "Parts",
    "Price",
    "Runtime",
    "Transformer",
    "check",
    "estimate",
    "phase_seconds",
    "price",
    "rank_stages",
    "readable_bytes",
    "schedule_of",
    "state_per_parameter",
    "sync_seconds",
]

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")  # Megatron-LM's two (Narayanan et al. 2021), zero-bubble's
SPLIT = frozenset({"zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"})  # a backward split into I, then W
V_SHAPED = SPLIT - {"zb-h1"}  # two chunks a rank in a V: rank r holds stages r and 2p - 1 - r


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: bool = True
    fsdp: bool = False  # the replicas shard the weights, gradients and optimizer state (FSDP2) instead of copying

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        chunks = f" v={self.chunks}" if self.chunks > 1 else ""
        flags = (" recompute" if self.recompute else "") + (" fsdp" if self.fsdp else "")
        sizes = f"tp{self.tp} pp{self.pp} dp{self.dp} b={self.micro_batch} m={self.num_microbatches}"
        return f"{sizes} {self.schedule}{chunks}{flags}"


@dataclass(frozen=True)
class Runtime:
    """What the training loop does that the layout does not say, as it changes the step's time."""

    overlap_grad_reduce: bool = False  # replicas' all-reduce during the last backward, in buckets (torch's DDP)
    bucket_bytes: float = 25 * 2**20  # DDP's bucket_cap_mb=25: the last bucket is reduced after the backward
    accumulate_bytes: float = 6.0  # a parameter's bytes moved to add a micro-batch's gradient to the kept one (fp16:
    # read both, write one); 0 where the weight-gradient matmul accumulates itself (Megatron-LM's later fusion)


PIPEENGINE = Runtime()  # a stage's AR starts after its last backward (pipeengine.parallel.gradsync); .grad accumulates


class Model(Protocol):
    """What the pricing needs of a model: ``Transformer`` (a decoder-only transformer's sizes and block) or
    ``sequential.Sequential`` (any nn.Sequential, traced layer by layer)."""

    @property
    def layers(self) -> int: ...

    @property
    def seq(self) -> int:  # tokens a sequence (what tokens/s counts)
        ...

    @property
    def parameters(self) -> float:  # the whole model's
        ...

    def flops_per_step(self, global_batch: int) -> float: ...

    def check(self, layout: Layout, hw: Hardware) -> None: ...

    def parts(self, layout: Layout, hw: Hardware, dtype: str, runtime: Runtime, exact: bool = True) -> Parts:
        """Stage times, sync and peak; ``exact=False``: the peak may be a lower bound (what the search prunes by)."""
        ...


@dataclass(frozen=True)
class Transformer:
    """What the pricing needs of a decoder-only transformer: its sizes, and the ops of one block (and of the
    embedding and head) at a tensor-parallel rank's shapes, traced on the meta device."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    parameters: float  # the whole model's
    block_ops: Callable[[int, int], list[Op]]  # (tp, micro_batch) -> a block's forward and backward ops
    head_ops: Callable[[int, int], list[Op]]  # (tp, micro_batch) -> the embedding's, the head's and the loss's
    dtype_bytes: int = 2
    flops_per_sequence: float | None = None  # the model's FLOPs a sequence (None: Narayanan et al.'s count)
    fused_attention: bool = False  # attention keeps no score matrix (flash, as block_ops traces it); else s x s a head

    def flops_per_step(self, global_batch: int) -> float:
        """The FLOPs one step computes: ``flops_per_sequence`` a sequence, or as Narayanan et al. 2021 count them
        (their eq. 3, recomputation included): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
        if self.flops_per_sequence is not None:
            return self.flops_per_sequence * global_batch
        b, s, h, layer, v = global_batch, self.seq, self.hidden, self.layers, self.vocab
        return 96 * b * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))

    def check(self, layout: Layout, hw: Hardware) -> None:
        """Tensor parallelism inside a node and dividing the heads; pp x chunks dividing the layers."""
        t, p, v = layout.tp, layout.pp, layout.chunks
        if t > hw.devices_per_node or hw.devices_per_node % t or self.heads % t:
            raise ValueError(
                f"tp={t}: tensor parallelism stays inside a node of {hw.devices_per_node} devices and "
                f"divides the {self.heads} heads: use a tp dividing both"
            )
        if self.layers % (p * v):
            raise ValueError(
                f"pp={p} x chunks={v} does not divide the {self.layers} layers: every stage holds whole "
                "layers, the same number each"
            )

    def parts(self, layout: Layout, hw: Hardware, dtype: str, runtime: Runtime, exact: bool = True) -> Parts:
        del exact  # the memory is a formula: exact either way
        return _parts(self, layout, hw, dtype, runtime)


@dataclass(frozen=True)
class Price:
    layout: Layout
    step_s: float
    tokens_per_s: float
    tflops_per_device: float  # the model's FLOPs (Narayanan et al.'s count) per device per second, in TFLOP/s
    mfu: float  # of the device's peak
    peak_bytes: float
    parts: dict[str, float]  # seconds of the step by cause (per device, on the critical rank)
    refused: str = ""  # why the layout cannot run (it is then priced nonetheless, for the table)
    partition: tuple[int, ...] = ()  # layers a stage (PipelineEngine's partition=), where the model is cut by time


def phase_seconds(ops: list[Op], hw: Hardware, dtype: str) -> dict[str, float]:
    """Seconds of each phase's ops: a matmul or attention at the matmul rate, anything else at the memory rate;
    "weight": the backward's ops only the weights' gradients need (its W; included in "backward")."""
    fast = hw.peak_flops[dtype] * hw.matmul_efficiency
    slow = hw.peak_flops.get("fp32", fast)
    out = {"forward": 0.0, "backward": 0.0, "weight": 0.0}
    for op in ops:
        rate = fast if op.kind in ("matmul", "attention") else slow
        seconds = max(op.flops / rate, op.bytes / hw.memory_bandwidth)
        out[op.phase] += seconds
        if op.weight:
            out["weight"] += seconds
    return out


def _embedding(op: Op) -> bool:
    """The embedding's lookup or its backward: the first stage's part of the ends; the rest is the last stage's."""
    return op.name.split(".")[1].startswith("embedding") if op.name.startswith("aten.") else False


@dataclass(frozen=True)
class Parts:
    """A layout's stage times and the rest of its step, before the schedule is replayed."""

    forward: list[float]  # seconds of each stage's forward of one micro-batch, its exchange included
    backward: list[float]  # the whole backward (I and W)
    weight: list[float]  # of which W: the weights' gradients (and their accumulation), which a split backward defers
    tp_all_reduces: float  # seconds a micro-batch spends in tensor parallelism's all-reduces, on one stage
    replicas: float  # the replicas' gradient all-reduce (FSDP: the weights' all-gather and gradients' reduce-scatter)
    optimizer: float
    peak_bytes: float
    partition: tuple[int, ...] = ()  # layers a stage, where the stages are cut unevenly (a Sequential's, by time)


def _parts(model: Transformer, layout: Layout, hw: Hardware, dtype: str, runtime: Runtime) -> Parts:
    t, p, b, v, m = layout.tp, layout.pp, layout.micro_batch, layout.chunks, layout.num_microbatches
    block = phase_seconds(model.block_ops(t, b), hw, dtype)
    ends_ops = model.head_ops(t, b)
    first = phase_seconds([op for op in ends_ops if _embedding(op)], hw, dtype)
    last = phase_seconds([op for op in ends_ops if not _embedding(op)], hw, dtype)
    activation = b * model.seq * model.hidden * model.dtype_bytes  # a block's input, one micro-batch
    tp_link = collectives.group_link(hw, t, 1)
    tp_ar = collectives.all_reduce(activation, t, tp_link) if t > 1 else 0.0
    recomputed = block["forward"] + 2 * tp_ar if layout.recompute else 0.0
    f_block = block["forward"] + 2 * tp_ar
    b_block = block["backward"] + 2 * tp_ar + recomputed
    per_stage = model.layers / (p * v)
    stages = p * v
    forward = [per_stage * f_block for _ in range(stages)]
    backward = [per_stage * b_block for _ in range(stages)]
    params_device = model.parameters / (t * p)
    accumulate = params_device / v * runtime.accumulate_bytes / hw.memory_bandwidth * (m - 1) / m  # a micro-batch's
    weight = [per_stage * block["weight"] + accumulate for _ in range(stages)]  # gradients added to the kept ones
    backward = [b_ + accumulate for b_ in backward]  # (all but the first micro-batch's): W's
    for stage, ends in ((0, first), (stages - 1, last)):
        forward[stage] += ends["forward"]
        backward[stage] += ends["backward"]
        weight[stage] += ends["weight"]
    if p > 1:  # Megatron-LM's exchanges block both ranks until done (batch_isend_irecv, wait, cuda.synchronize)
        message = collectives.send_recv(activation / t, collectives.group_link(hw, p, t))  # scatter: 1/t a rank
        if t > 1:
            message += collectives.all_gather(activation, t, tp_link)  # and gather
        forward = [f + message for f in forward]
        backward = [b_ + message for b_ in backward]
    replicas, optimizer = sync_seconds(params_device, model.dtype_bytes, layout, hw, runtime, backward)
    tp_time = per_stage * v * (6 if layout.recompute else 4) * tp_ar
    return Parts(forward, backward, weight, tp_time, replicas, optimizer, _memory(model, layout, activation))


def rank_stages(layout: Layout) -> list[list[int]]:
    """Each pipeline rank's stages: in a V (V_SHAPED), rank r holds stages r and 2p - 1 - r; else r, r + p, ..."""
    p = layout.pp
    if layout.schedule in V_SHAPED:
        return [[rank, 2 * p - 1 - rank] for rank in range(p)]
    return [list(range(rank, p * layout.chunks, p)) for rank in range(p)]


def state_per_parameter(layout: Layout) -> float:
    """Bytes a device holds a step for each parameter of its stages, as mixed precision keeps them: fp16 weight and
    gradient, fp32 master and two moments (16); under FSDP, the whole fp16 weights and gradients for the step and the
    12 bytes of master and moments divided among the replicas."""
    return 4 + 12 / layout.dp if layout.fsdp else 16.0


def sync_seconds(
    params_device: float, dtype_bytes: int, layout: Layout, hw: Hardware, runtime: Runtime, backward: list[float]
) -> tuple[float, float]:
    """Seconds of the replicas' gradient sync (FSDP: the weights' all-gather and the gradients' reduce-scatter) and
    of the optimizer, for a device holding ``params_device`` parameters of the stages whose backward of one
    micro-batch take ``backward`` seconds."""
    t, p, d = layout.tp, layout.pp, layout.dp
    link = collectives.group_link(hw, d, t * p)
    gradients = params_device * dtype_bytes
    gather = 0.0
    if d == 1:
        reduce = 0.0
    elif layout.fsdp:  # FSDP2 as pipeengine runs it: a stage's weights gathered once a step, before its first forward
        gather = collectives.all_gather(gradients, d, link)  # (kept for the step), the gradients reduce-scattered
        reduce = collectives.reduce_scatter(gradients, d, link)  # once after its last backward
    else:
        reduce = collectives.all_reduce(gradients, d, link)
    if reduce and runtime.overlap_grad_reduce:  # hidden behind the rank's last backward, but for its last bucket
        mine = rank_stages(layout)[0]  # rank 0's stages
        last_backward = sum(backward[stage] for stage in mine)  # one micro-batch
        tail = collectives.all_reduce(min(gradients, runtime.bucket_bytes), d, link)
        reduce = max(tail, reduce - last_backward)
    optimizer = params_device / (d if layout.fsdp else 1) * 38 / hw.memory_bandwidth  # fp16 grad read, fp32 master,
    # moments read and written: each replica its shard under FSDP
    return gather + reduce, optimizer


def _priced(model: Model, layout: Layout, hw: Hardware, dtype: str, parts: Parts, pipeline: float) -> Price:
    step = pipeline + parts.replicas + parts.optimizer
    global_batch = layout.micro_batch * layout.num_microbatches * layout.dp
    flops = model.flops_per_step(global_batch) / step / layout.devices
    refused = (
        f"needs {readable_bytes(parts.peak_bytes)} a device, the device has {readable_bytes(hw.memory_bytes)}"
        if parts.peak_bytes > hw.memory_bytes
        else ""
    )
    shares = {
        "pipeline": pipeline,
        "data-parallel sync": parts.replicas,
        "optimizer": parts.optimizer,
        "tensor-parallel all-reduces": layout.num_microbatches * parts.tp_all_reduces,
    }
    return Price(
        layout,
        step,
        global_batch * model.seq / step,
        flops / 1e12,
        flops / hw.peak_flops[dtype],
        parts.peak_bytes,
        shares,
        refused,
        parts.partition,
    )


def readable_bytes(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check(model: Model, layout: Layout, hw: Hardware) -> None:
    """Refuse a layout the search would never build, naming the rule and the values: a schedule priced here
    (SCHEDULES), with its chunks (ZB-V: 2; interleaved: micro-batches a multiple of pp), and the model's own rules
    (``model.check``: a transformer's tensor parallelism inside a node and dividing the heads, the pipeline dividing
    its layers)."""
    p, v, m = layout.pp, layout.chunks, layout.num_microbatches
    if layout.schedule not in SCHEDULES:
        raise ValueError(
            f"schedule {layout.schedule!r} is not priced on clusters (its memory is not modelled here): "
            f"use one of {', '.join(SCHEDULES)}"
        )
    model.check(layout, hw)
    wanted = {"zb-v": 2, "1f1b": 1, "zb-h1": 1}.get(layout.schedule)
    if wanted is not None and v != wanted:
        raise ValueError(f"{layout.schedule} runs {wanted} chunk(s) a rank, got chunks={v}")
    if layout.schedule == "interleaved" and p > 1 and m % p:
        raise ValueError(f"interleaved: {m} micro-batches is not a multiple of pp={p} (Megatron-LM's rule)")


def price(model: Model, layout: Layout, hw: Hardware, dtype: str = "fp16", runtime: Runtime = PIPEENGINE) -> Price:
    """The layout's step time and memory per device (the module's docstring says how): the schedule replayed."""
    from schedules import Costs
    from schedules.sim.simulation import summarize

    parts = model.parts(layout, hw, dtype, runtime)
    p, m, v = layout.pp, layout.num_microbatches, layout.chunks
    if p == 1:
        pipeline = m * sum(parts.forward + parts.backward)  # one rank: its stages back to back, no bubble
    else:
        schedule = schedule_of(layout.schedule, p, m, v)
        inputs = [b_ - w for b_, w in zip(parts.backward, parts.weight, strict=True)]  # a split backward's I, then W
        costs = Costs(
            forward=parts.forward, backward=parts.backward, backward_input=inputs, backward_weight=parts.weight
        )  # each schedule runs B whole, or I and W apart
        pipeline = summarize(schedule, costs).makespan
    return _priced(model, layout, hw, dtype, parts, pipeline)


def estimate(model: Model, layout: Layout, hw: Hardware, dtype: str = "fp16", runtime: Runtime = PIPEENGINE) -> Price:
    """``price`` with the pipeline's bubble from a formula instead of the replay, what the search prunes by: for
    1F1B and interleaved, (m + (p - 1) / v) slots of the slowest stage's forward and backward (Narayanan et al. 2021,
    section 2.2); for a split backward, m slots and (p - 1) (F + I - W) of a stage (Qi et al. 2024, ZB-H1's
    bubble, which the V-shaped schedules are only near: the replay ranks them)."""
    parts = model.parts(layout, hw, dtype, runtime, exact=False)
    p, m, v = layout.pp, layout.num_microbatches, layout.chunks
    slowest = max(range(p * v), key=lambda stage: parts.forward[stage] + parts.backward[stage])
    f, b, w = parts.forward[slowest], parts.backward[slowest], parts.weight[slowest]
    if p == 1:
        pipeline = m * sum(parts.forward + parts.backward)
    elif layout.schedule in SPLIT:
        pipeline = m * (f + b) * v + (p - 1) * max(0.0, f + b - 2 * w)
    else:
        pipeline = (m + (p - 1) / v) * (f + b) * v
    return _priced(model, layout, hw, dtype, parts, pipeline)


@functools.lru_cache(maxsize=64)
def schedule_of(name: str, p: int, m: int, chunks: int | None):  # type: ignore[no-untyped-def]
    from schedules import build_schedule

    return build_schedule(name, p, m, chunks=chunks)


def _memory(model: Transformer, layout: Layout, activation: float) -> float:
    """Bytes a device of the first stage holds at its peak (the module's docstring)."""
    t, p = layout.tp, layout.pp
    # FSDP: the stage's whole fp16 weights and gradients for the step, the fp32 master and moments sharded
    state = model.parameters / (t * p) * state_per_parameter(layout)
    in_flight = min(layout.num_microbatches, p)  # 1F1B's first stage
    per_stage = model.layers / p
    h, s, a, b = model.hidden, model.seq, model.heads, layout.micro_batch
    scores = 0.0 if model.fused_attention else 5 * a * s / (h * t)  # the s x s softmax and its dropout mask a head
    whole_block = s * b * h * (10 + 24 / t + scores)  # Korthikanti et al. 2022, eq. 2 (bytes, fp16)
    if layout.recompute:
        kept = in_flight * per_stage * activation + whole_block
    else:
        kept = in_flight * per_stage * whole_block
    return state + kept
