"""One configuration of the composition matrix, on every rank of a world, against one process doing the same work.

    run(config, directory)   build the model and a deep copy, the engine, then for each of ``accumulate`` steps
                             (no zero_grad between) the loss and every gradient against the one process; the
                             optimizer's step (SGD with momentum) and every weight; then what the step is followed by

The one process (OneProcess, tests/pipeengine/parity.py) runs the engine's work micro-batch by micro-batch, stage by
stage: under autocast with the floating tensors crossing each boundary cast as the engine casts them, each loss
weighted as the engine weights it (1/(m dp), or 1/the global count of units), so in float32 the two differ by
summation order alone; batch norms see each replica's micro-batches, and keep replica 0's statistics (as the engine's
replicas do). Tolerances follow from that: float32's (rtol 1e-5, atol 4e-5) where the one process rounds as the
engine does; a few units of bf16's or fp16's where it cannot: a tensor-parallel layer rounds its partial sums before
adding them, a compiled region may order its operations otherwise; an eval_step's output, which passed every
tensor-parallel reduction of the model (each rounding the partial sums one process adds unrounded), 4 units more for
each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine, hf
from pipeengine.core.dtensors import whole
from tests.composition import Config
from tests.pipeengine import parity, ranks
from tests.pipeengine.models import SEEDED
from tests.pipeengine.parity import OneProcess

T = TypeVar("T")
M = 4  # micro-batches: DualPipeV needs 2 per rank
ROWS = 8  # a replica's batch: 2 rows per micro-batch
LR = 0.1


@dataclass
class Model:
    """A model of the matrix: the Sequential, its partitions, its plan, its losses and data."""

    seq: nn.Sequential
    hf_model: nn.Module | None  # the Hugging Face model whose modules the Sequential holds (llama)
    partition: dict[int, list[int]]  # stages -> layers per stage: every tensor-parallel pair inside a stage
    plan: dict[str, object]
    loss: Callable[..., torch.Tensor]  # as the config's loss: a mean, or a sum
    count: Callable[[object], object] | None  # loss_count, with the sum
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # seed -> (inputs, targets), ROWS rows
    blocks: tuple[int, ...]  # the layers "compiled blocks" compiles


def build(config: Config, seed: int = 0) -> Model:
    tied = config.tie != "none"
    if config.model == "mlp":
        return _mlp(config.loss, tied, seed)
    if config.model == "gpt":
        return _gpt(config.loss, tied, seed)
    return _llama(config.loss, tied, seed)


def _mlp(loss: str, tied: bool, seed: int) -> Model:
    """A batch norm, two column-then-row pairs (each inside a stage), the last Linear square: it can be the first's."""
    with SEEDED:
        torch.manual_seed(seed)
        seq = nn.Sequential(
            nn.Linear(8, 8),
            nn.BatchNorm1d(8),
            nn.Tanh(),
            nn.Linear(8, 16),
            nn.Linear(16, 8),
            nn.Tanh(),
            nn.Linear(8, 16),
            nn.Linear(16, 8),
            nn.Linear(8, 8),
        )
        if tied:
            seq[8].weight = seq[0].weight
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"3": ColwiseParallel(), "4": RowwiseParallel(), "6": ColwiseParallel(), "7": RowwiseParallel()}

    def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(7000 + seed)
        return torch.randn(ROWS, 8, generator=generator), torch.randn(ROWS, 8, generator=generator)

    mean, summed = F.mse_loss, lambda out, y: ((out.float() - y) ** 2).sum()
    return Model(
        seq,
        None,
        {2: [5, 4], 4: [3, 2, 1, 3]},
        plan,
        mean if loss == "mean" else summed,
        None if loss == "mean" else lambda y: y.numel(),
        data,
        (3, 4, 6, 7),
    )  # type: ignore[union-attr]


def _gpt(loss: str, tied: bool, seed: int) -> Model:
    from tests.pipeengine import gpt

    seq = gpt.headwise_gpt(tied, blocks=2)
    if seed:
        _reseed(seq, seed)

    def mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # a head sharded on the vocabulary (the tie's plan): a DTensor
        return gpt.one_process_loss(whole(logits), targets)

    return Model(
        seq,
        None,
        {2: [2, 2], 4: [1, 1, 1, 1]},
        gpt.tp_plan(tied),
        mean if loss == "mean" else gpt.whole_token_sum,
        None if loss == "mean" else gpt.count_tokens,
        lambda seed: gpt.tp_batch(ROWS, seed),
        (1, 2),
    )


def _llama(loss: str, tied: bool, seed: int) -> Model:
    from tests.pipeengine import hf_models

    model = hf_models.build("llama", layers=2, tied=tied)
    if seed:
        _reseed(model, seed)

    def mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=hf.IGNORE)

    return Model(
        hf.sequential(model),
        model,
        {2: [2, 2], 4: [1, 1, 1, 1]},
        hf.tp_plan(model),
        mean if loss == "mean" else hf.causal_lm_loss,
        None if loss == "mean" else hf.count_labels,
        lambda seed: hf_models.batch(ROWS, seed),
        (1, 2),
    )


def _reseed(model: nn.Module, seed: int) -> None:
    """Other weights, alike on every rank (the ranks may share one process): what a checkpoint then replaces."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def tolerance(config: Config, units: int = 4) -> dict[str, float]:
    """See the module docstring: ``units`` of the precision's rounding where the one process cannot round alike."""
    if config.precision == "fp32" or (config.tp == 1 and config.compile == "off"):
        return {"rtol": 1e-5, "atol": 4e-5}
    unit = {"bf16": 2.0**-8, "fp16": 2.0**-10}[config.precision]
    return {"rtol": units * unit, "atol": units * unit}


def reductions(model: Model) -> int:
    """The tensor-parallel reductions a forward through the whole model passes: its row-parallel layers, each adding
    partial sums that each rank rounded first."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    rows = [pattern for pattern, style in model.plan.items() if isinstance(style, RowwiseParallel)]
    return sum(any(fnmatch.fnmatchcase(name, pattern) for pattern in rows) for name, _ in model.seq.named_modules())


def close(actual: object, expected: object, config: Config, what: str, units: int = 4) -> None:
    compare(config, units)(actual, expected, f"{config}\n{what}")


def compare(config: Config, units: int = 4) -> parity.Compare:
    """parity.close in float, within the configuration's tolerance."""

    def within(actual: object, expected: object, what: str) -> None:
        actual = whole(torch.as_tensor(actual)).detach().float()
        expected = whole(torch.as_tensor(expected)).detach().float()
        parity.close(actual, expected, what, **tolerance(config, units))

    return within


DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def one_step(
    one: OneProcess,
    config: Config,
    bounds: list[tuple[int, int]],
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> float:
    """The one process's step as the engine of ``config`` runs it: micro-batch by micro-batch, stage by stage."""
    return one.step(
        parts, microbatches=M, count=one.model.count, bounds=bounds, dtype=DTYPES[config.precision], scale=scale
    )


def engine_for(config: Config, model: Model) -> PipelineEngine:
    stages = 4 if config.schedule in ("interleaved", "zb-v", "v-half", "v-min", "dualpipe-v") else 2
    return PipelineEngine(
        model.seq,
        model.loss,
        num_microbatches=M,
        schedule=config.schedule,
        partition=model.partition[stages],
        data_parallel=config.data_parallel,
        fsdp=config.data.startswith("fsdp"),
        reshard_after_forward=config.data == "fsdp-reshard",
        tensor_parallel=config.tp,
        tp_plan=model.plan if config.tp > 1 else None,
        loss_count=model.count,
        precision=None if config.precision == "fp32" else config.precision,
        checkpoint=config.checkpoint,
    )


def compiled(model: Model) -> None:
    for index in model.blocks:
        model.seq[index].compile(backend="aot_eager")


class Once:
    """The one process's work, done once per world and read by every rank: by the first of in-process ranks
    (threads share the result), or by rank 0 of processes, which sends what it found to the others."""

    def __init__(self, tag: object) -> None:
        self.world, self.tag, self.calls = ranks.world(), tag, 0

    def holder(self, make: Callable[[], T]) -> T | None:
        """An object the work is done on: one for every thread, or rank 0's alone (None elsewhere)."""
        return self(make, send=False)

    def __call__(self, compute: Callable[[], T], send: bool = True) -> T:
        self.calls += 1
        if self.world.shared_clock:
            return self.world.computed_once((self.tag, self.calls), compute)
        value = compute() if self.world.rank == 0 else None
        if not send:
            return value  # type: ignore[return-value]
        return self.world.all_gather_object(value, "the one process's results")[0]  # type: ignore[no-any-return]


def _state(seq: nn.Module, grads: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "grads": {n: p.grad.detach().clone() for n, p in seq.named_parameters() if p.grad is not None} if grads else {},
        "weights": {n: p.detach().clone() for n, p in seq.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in seq.named_buffers()},
    }


def run(config: Config, directory: str) -> None:
    """The configuration on every rank of this world (see the module docstring)."""
    model = build(config)
    once = Once(str(config))
    one = once.holder(lambda: _reference(model, config))
    if config.compile == "on":
        compiled(model)
    engine = engine_for(config, model)
    scale = 1.0
    if config.precision == "fp16":
        engine.scaler.scale = scale = 2.0**8  # 2**16 overflows these models' fp16 gradients (the scaler's business)
    profiler = None
    for step in range(config.accumulate):
        parts = [model.batch(100 * step + r) for r in range(config.data_parallel)]
        x, y = parts[engine.dp_rank]
        if config.after == "trace" and config.processes:  # inside the user's profiler (one per process: not threads)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        with engine.tracing() if config.after == "trace" else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        if profiler is not None:
            profiler.__exit__(None, None, None)
        expected = once(lambda p=parts: (one_step(one, config, engine.bounds, p, scale), _state(one.seq)))  # type: ignore[arg-type, union-attr, misc]
        close(loss, expected[0], config, f"step {step}: the loss")
        _gradients(engine, expected[1], config, f"{step + 1} accumulated steps", scale)
    _buffers(engine, expected[1], config)
    if config.after == "trace":
        _traced(engine, config, profiler)
    if config.after == "clip":
        if config.precision == "fp16":
            engine.scaler.unscale_()
        norm = engine.clip_grad_norm_(0.5)
        expected = once(lambda: (float(torch.nn.utils.clip_grad_norm_(one.seq.parameters(), 0.5)), _state(one.seq)))  # type: ignore[union-attr]
        close(norm, expected[0], config, "the clipped norm")
        _gradients(engine, expected[1], config, "clipped")
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR, momentum=0.9)
    theirs = once.holder(lambda: torch.optim.SGD(one.seq.parameters(), lr=LR, momentum=0.9))  # type: ignore[union-attr]
    if config.precision == "fp16":
        assert engine.scaler.step(optimizer), f"{config}: the scaler skipped the step"
        engine.scaler.update()
    else:
        optimizer.step()
    stepped = once(lambda: (theirs.step(), _state(one.seq, grads=False))[1])  # type: ignore[union-attr]
    _weights(engine, stepped, config, "after the optimizer's step")
    if config.after == "eval":
        _evaluated(engine, once, one, model, config)
    elif config.after == "reload":
        _reloaded(engine, optimizer, once, one, theirs, config, directory)
    elif config.after == "hf-export":
        _exported(engine, model, once, one, config, directory)


def _reference(model: Model, config: Config) -> OneProcess:
    """The one process: a deep copy of the model (its Sequential and the Hugging Face model it is made of, alike)."""
    one = OneProcess(model, model.loss, seq=lambda copy: copy.seq)
    if config.compile == "on":
        compiled(one.model)
    return one


def _gradients(
    engine: PipelineEngine, state: dict[str, dict[str, torch.Tensor]], config: Config, what: str, scale: float = 1.0
) -> None:
    """Every gradient (fp16: the engine's still times the loss scale until the scaler unscales them)."""
    grads = {name: state["grads"].get(name) for name in state["weights"]}
    parity.check_grads(engine, grads, f"{config}\n{what}", scale=scale, compare=compare(config))


def _weights(engine: PipelineEngine, state: dict[str, dict[str, torch.Tensor]], config: Config, what: str) -> None:
    parity.check_weights(engine, state["weights"], f"{config}\n{what}", compare=compare(config))


def _buffers(engine: PipelineEngine, state: dict[str, dict[str, torch.Tensor]], config: Config) -> None:
    """Batch norm's statistics: replica 0's on every replica, as one process computed them from its micro-batches."""
    for name, value in engine.state_dict().items():
        if "running_" in name or "num_batches" in name:
            close(value, state["buffers"][name], config, f"buffer {name} on replica {engine.dp_rank}")


def _traced(engine: PipelineEngine, config: Config, profiler: torch.profiler.profile | None) -> None:
    timeline = engine.timeline()
    if ranks.rank() == 0:
        assert timeline is not None and timeline.memory is not None, f"{config}: no traced timeline"
        computes = [span for span in timeline.spans if span.is_compute]
        assert len(computes) >= 2 * M, f"{config}: {len(computes)} compute spans traced"
    if profiler is not None:  # the user's profiler kept recording: each instruction a range in it
        mine = {f"pipeengine/{op}" for op in engine.last_program.instructions[engine.rank] if hasattr(op, "kind")}  # type: ignore[union-attr]
        names = {event.name() for event in profiler.profiler.kineto_results.events()}  # type: ignore[union-attr]
        missing = mine - names  # (the raw events: profiler.events() builds their tree, a second a step)
        assert not missing, f"{config}: the user's profiler lacks {sorted(missing)[:5]}"


def _evaluated(engine: PipelineEngine, once: Once, one: OneProcess | None, model: Model, config: Config) -> None:
    x, _ = model.batch(999)
    engine.eval()
    out = engine.eval_step(x if engine.first else None)
    engine.train()

    def forward() -> torch.Tensor:
        one.seq.eval()  # type: ignore[union-attr]
        with torch.no_grad():
            value = one.forward(x, engine.bounds, DTYPES[config.precision])  # type: ignore[union-attr]
        one.seq.train()  # type: ignore[union-attr]
        return value  # type: ignore[return-value]

    expected = once(forward)
    if engine.last:  # the output passed every reduction of the model (a gradient, those behind its layer only)
        units = 4 * (1 + reductions(model)) if config.tp > 1 else 4
        close(out, expected, config, "eval_step's output", units)


def _reloaded(
    engine: PipelineEngine,
    optimizer: torch.optim.Optimizer,
    once: Once,
    one: OneProcess | None,
    theirs: torch.optim.Optimizer | None,
    config: Config,
    directory: str,
) -> None:
    """Saved in this layout, loaded into another of the same world (its replicas, two pipeline positions, no tensor
    parallelism nor sharding, another schedule and partition), in float32: the weights, SGD's momentum (the next
    step) and the buffers carry over."""
    engine.save(directory, optimizer)
    other = build(config, seed=11)  # other weights: the checkpoint replaces them
    replicas = ranks.size() // 2
    layout = dataclasses.replace(
        config,
        schedule="gpipe" if config.schedule != "gpipe" else "1f1b",
        tp=1,
        data="dp2" if replicas > 1 else "dp1",
        precision="fp32",
        checkpoint="never",
    )
    loaded = PipelineEngine(
        other.seq,
        other.loss,
        num_microbatches=M,
        schedule=layout.schedule,
        partition=[len(other.seq) - 1, 1],
        data_parallel=replicas,
        loss_count=other.count,
    )
    second = torch.optim.SGD(loaded.parameters(), lr=LR, momentum=0.9)
    loaded.load(directory, second)
    before = once(lambda: _state(one.seq, grads=False))  # type: ignore[union-attr]
    # the weights were trained in the configuration's precision: within its tolerance of the one process's, and
    # so after the step in float32 (the message names the layout)
    where = f"loaded into {layout}"
    _weights(loaded, before, config, where)
    _buffers(loaded, before, config)
    parts = [other.batch(500 + r) for r in range(replicas)]
    x, y = parts[loaded.dp_rank]
    loss = loaded.train_step(x if loaded.first else None, y if loaded.last else None)
    second.step()

    def step() -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
        theirs.zero_grad()  # type: ignore[union-attr]
        value = one_step(one, layout, loaded.bounds, parts, 1.0)  # type: ignore[arg-type]
        theirs.step()  # type: ignore[union-attr]
        return value, _state(one.seq, grads=False)  # type: ignore[union-attr]

    expected = once(step)
    close(loss, expected[0], config, f"{where}: the loss after loading")
    _weights(loaded, expected[1], config, f"{where}: a step after loading (SGD's momentum loaded)")


def _exported(
    engine: PipelineEngine, model: Model, once: Once, one: OneProcess | None, config: Config, directory: str
) -> None:
    """hf.save_pretrained writes the trained weights of the user's model: from_pretrained computes the one process's
    logits."""
    import transformers

    x, _ = model.batch(998)

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return one.model.hf_model(x).logits  # type: ignore[union-attr, misc, no-any-return]

    expected = once(logits)
    written = hf.save_pretrained(engine, model.hf_model, directory)  # type: ignore[arg-type]
    if written is not None:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(Path(written))
        with torch.no_grad():
            close(loaded(x).logits, expected, config, "from_pretrained's logits")
