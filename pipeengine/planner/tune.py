"""tune: choose schedule, split size, chunks and partition for a model before launching, under a memory limit.

    result = tune(model, loss_fn, sample, world_size=4, memory_limit=2 * 2**30)
    print(result)                                                # every candidate, fastest first
    engine = PipelineEngine(model, loss_fn, **result.best.engine_kwargs())

Each layer is measured once per candidate micro-batch size on ``sample`` (an input batch:
pipeengine.planner.profiler). Then every candidate (each registered schedule; each micro-batch count that
divides the batch; each chunk count the schedule runs; the exact min-max partition by time, by
memory, by parameters and uniform) is priced by the simulator, time and bytes, without running
it: the step's makespan, its bubble, and each rank's peak memory. Candidates whose peak passes
``memory_limit`` on any rank are dropped; the result says how many and what the limit cost.

    python -m pipeengine.tune examples.train_gpt:planning --world-size 4 --memory-limit 64MiB
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn

from pipeengine.comm.backends import BACKENDS
from pipeengine.comm.backends import backend as backend_named
from pipeengine.comm.base import Transport
from pipeengine.core.config import EngineConfig
from pipeengine.core.specs import Tensors, unpack
from pipeengine.launcher.launch import keep_freed_memory
from pipeengine.planner.partition import method_costs, solve
from pipeengine.planner.profiler import LayerCosts, LayerProfile, profile_layers
from schedules import SCHEDULES, Schedule, Semantics, build_schedule, registration, simulate

__all__ = ["Candidate", "TuneResult", "choose", "progress_printer", "tune"]

# host seconds per compute beyond its kernels, on CPU/gloo: its span 0.13 ms, a post 0.08 ms, 0.05 ms between
# instructions (a traced 2-rank 1F1B of Linear(8) layers, m=32, on the 2-core machine of the benchmarks)
OVERHEAD = 3e-4
LATENCY, PER_BYTE = 1e-4, 1e-9  # a message on loopback gloo: ~0.1 ms, ~1 GB/s (benchmarks/vs_torch.py probes)



@dataclass(frozen=True)
class Candidate:
    """One way to pipeline the model, priced by the simulator."""

    schedule: str
    num_microbatches: int
    chunks: int
    methods: tuple[str, ...]  # the partition methods that cut it this way
    partition: tuple[int, ...]  # layers per stage
    step_time: float  # predicted seconds per step
    bubble: float
    peak_memory: tuple[float, ...]  # bytes per rank that must fit: the step's peak or the optimizer step's after it
    data_parallel: int = 1  # replicas of the pipeline it was priced for
    fsdp: bool = False  # priced with each stage's state sharded over the replicas

    def engine_kwargs(self) -> dict[str, object]:
        """The PipelineEngine options that build exactly what was priced:
        ``PipelineEngine(model, loss_fn, **c.engine_kwargs())``."""
        kwargs: dict[str, object] = {"schedule": self.schedule, "num_microbatches": self.num_microbatches,
                                     "chunks": self.chunks, "partition": list(self.partition),
                                     "data_parallel": self.data_parallel}  # fmt: skip
        return {**kwargs, "fsdp": True} if self.fsdp else kwargs

    def fits(self, limit: float | None) -> bool:
        return limit is None or max(self.peak_memory) <= limit


@dataclass
class TuneResult:
    """Every candidate that fits, fastest first (``rows``); those the memory limit dropped (``dropped``)."""

    rows: list[Candidate]
    dropped: list[Candidate] = field(default_factory=list)
    memory_limit: float | None = None
    search_seconds: float = 0.0  # pricing every candidate, after the layers were measured
    measure_seconds: float = 0.0

    @property
    def best(self) -> Candidate:
        if not self.rows and not self.dropped:
            raise ValueError("no candidate was priced: see tune()'s reasons")
        if not self.rows:
            least = min(self.dropped, key=lambda c: max(c.peak_memory))
            raise ValueError(
                f"no candidate fits memory_limit={_mb(self.memory_limit)} per rank: the least memory any needs is "
                f"{_mb(max(least.peak_memory))} ({least.schedule}, m={least.num_microbatches}, partition "
                f"{list(least.partition)}); raise the limit, use more ranks, or checkpoint activations"
            )
        return self.rows[0]

    def binding(self) -> str:
        """What the memory limit cost: which candidates it dropped, and the fastest of them."""
        if not self.dropped:
            return "no candidate was dropped for memory"
        faster = [c for c in self.dropped if not self.rows or c.step_time < self.rows[0].step_time]
        text = f"memory_limit={_mb(self.memory_limit)} per rank dropped {len(self.dropped)} candidates"
        if faster:
            top = min(faster, key=lambda c: c.step_time)
            rank = top.peak_memory.index(max(top.peak_memory))
            text += (
                f"; without it the fastest would be {top.schedule} m={top.num_microbatches} "
                f"({top.step_time * 1e3:.2f} ms), peaking at {_mb(max(top.peak_memory))} on rank {rank}"
            )
        return text

    def __str__(self) -> str:
        lines = [f"{len(self.rows)} candidates (priced in {self.search_seconds:.2f} s after "
                 f"{self.measure_seconds:.2f} s measuring the layers); {self.binding()}",
                 f"{'#':>3}  {'schedule':11} {'m':>3} {'v':>2}  {'step ms':>8}  {'bubble':>6}  {'peak MiB/rank':24}  "
                 "partition (methods)"]  # fmt: skip
        for index, c in enumerate(self.rows[:20]):
            peaks = " ".join(f"{b / 2**20:.1f}" for b in c.peak_memory)
            lines.append(f"{index:3d}  {c.schedule:11} {c.num_microbatches:3d} {c.chunks:2d}  "
                         f"{c.step_time * 1e3:8.2f}  {c.bubble:6.1%}  {peaks:24}  {list(c.partition)} "
                         f"({', '.join(c.methods)})")  # fmt: skip
        if len(self.rows) > 20:
            lines.append(f"... and {len(self.rows) - 20} more")
        return "\n".join(lines)


def tune(
    model: nn.Sequential,
    loss_fn: Callable[..., torch.Tensor] | None,
    sample: torch.Tensor | Tensors,
    world_size: int,
    *,
    target: torch.Tensor | Tensors | None = None,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    fsdp: bool = False,
    compile: bool | Mapping[str, object] = False,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] | None = None,
    methods: Sequence[str] = ("time", "memory", "parameters", "uniform"),
    max_microbatches: int = 64,
    backend: str = "gloo",
    optimizer_copies: int = 2,
    overhead: float = OVERHEAD,
    latency: float = LATENCY,
    per_byte: float = PER_BYTE,
    repeats: int = 3,
    threads: int | None = None,
    device: str | torch.device | None = None,
    reuse_memory: bool = True,
    allocator: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
) -> TuneResult:
    """Price every way to pipeline ``model`` on ``world_size`` ranks; see the module docstring.

    ``sample``: an input batch of one data-parallel replica (its first dimension is the batch);
    ``target``: its targets: with them ``loss_fn`` is measured as part of the last layer (its time, and
    what it saves for backward, e.g. a cross entropy's log-probabilities); without them it is left out.
    ``backend``: the transport that will run it (pipeengine.comm.base): "gloo" posts every recv of a step at its
    start (so its buffers count from then) and frees a send's buffer once posted, "nccl" runs the program as
    lowered and holds a send's buffer until it completes, "loopback" (``launch(in_process=True)``) runs it as
    lowered with gloo's buffered sends. ``threads``: torch threads while timing the layers (default: the cores
    shared out among the world's ranks on one machine, as launch() does). ``reuse_memory``: on CPU, time the
    layers with glibc keeping freed memory, as launch()'s ranks run by default (pipeengine.launch.keep_freed_memory;
    it stays set in this process): otherwise each fresh weight gradient pays page faults the ranks do not (W of
    the benchmark MLP's layers at 32 rows measured 22.9 ms without, 11.4 ms with). ``allocator``: watch each
    layer's computes with the allocator (pipeengine.planner.transients), so that a candidate's peak counts what
    the allocator sees (the computes' temporaries, the gradient-sync buffers, the optimizer step after the step;
    AdamW's), not only what the step keeps between computes: ``memory_limit`` guards that figure.
    ``latency``, ``per_byte`` and ``overhead`` are constants, measured once on the 2-core machine of the
    benchmarks (see their comments), not on this one: pass your own. ``progress(done, layers, sizes)``: called as the
    layers are measured, with done=0 first, then after each layer at each micro-batch size (of layers x sizes);
    ``progress_printer()`` writes it to stderr, as ``python -m pipeengine.tune`` does.
    """
    _check_problem(model, sample, target)
    for label, value in (("world_size", world_size), ("data_parallel", data_parallel),
                         ("max_microbatches", max_microbatches), ("repeats", repeats),
                         *(("each of microbatches", m) for m in microbatches or ())):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if fsdp and data_parallel < 2:
        raise ValueError(f"fsdp=True shards the state over the data-parallel replicas, but data_parallel="
                         f"{data_parallel}: pass data_parallel=2 (or more), or leave fsdp out")  # fmt: skip
    if world_size % data_parallel:
        raise ValueError(f"world_size={world_size} does not split into data_parallel={data_parallel} pipelines")
    transport = backend_named(backend)  # its program, and whether a sent buffer is free once posted (buffered)
    buffered = transport.semantics is Semantics.BUFFERED
    ranks, layers = world_size // data_parallel, len(model)
    if ranks > layers:
        raise ValueError(
            f"no candidate: a pipeline of {ranks} ranks (world_size={world_size} / data_parallel={data_parallel}) "
            f"needs at least {ranks} layers, one per stage, and the model has {layers}; use at most {layers} pipeline "
            "ranks (more data_parallel replicas, or fewer ranks), or split the model into more nn.Sequential layers"
        )
    batch = unpack(sample)[0].shape[0]
    names = list(schedules or SCHEDULES)
    for name in names:
        registration(name)  # an unknown name fails here, with the valid ones
    counts = sorted(m for m in (microbatches or range(1, min(batch, max_microbatches) + 1)) if batch % m == 0)
    if not counts:
        raise ValueError(f"no micro-batch count in {list(microbatches or [])} divides the batch of {batch}")
    started = time.perf_counter()
    where = torch.device(device) if device is not None else torch.device("cpu")
    share = threads or max(1, (os.cpu_count() or 1) // world_size)
    if where.type == "cpu" and reuse_memory:
        keep_freed_memory()
    done = 0
    if progress is not None:
        progress(0, layers, len(counts))

    def layer_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, layers, len(counts))

    profiles = {m: profile_layers(model, sample, batch // m, repeats=repeats, device=where, threads=share,
                                  loss=loss_fn, target=target, allocator=allocator, compile=compile,
                                  progress=layer_done)
                for m in counts}  # fmt: skip
    measured = time.perf_counter() - started

    started = time.perf_counter()
    seen: dict[tuple[str, int, int, tuple[int, ...]], int] = {}
    candidates: list[Candidate] = []
    refusals: dict[str, str] = {}  # schedule -> why it gave no candidate (the last reason)
    for name in names:
        record = registration(name)
        for chunks in record.chunks or tuple(v for v in (2, 3, 4) if ranks * v <= layers):
            stages = ranks * chunks
            if stages > layers:
                continue
            for m in counts:
                try:
                    schedule = build_schedule(name, ranks, m, chunks)
                except ValueError as error:  # m does not suit this schedule (interleaved: a multiple of p)
                    refusals[name] = str(error)
                    continue
                program = transport.program(schedule)
                profile = profiles[m]
                for method in methods:
                    bounds = solve(method_costs(method, LayerCosts.of(profile, model)), stages)
                    partition = tuple(b - a for a, b in bounds)
                    key = (name, m, chunks, partition)
                    if key in seen:  # another method cut it the same way
                        old = candidates[seen[key]]
                        candidates[seen[key]] = Candidate(**{**old.__dict__, "methods": (*old.methods, method)})
                        continue
                    seen[key] = len(candidates)
                    candidates.append(_price(name, m, chunks, method, bounds, program, profile, buffered,
                                             optimizer_copies, overhead, latency, per_byte, data_parallel,
                                             fsdp))  # fmt: skip
    if not candidates:
        why = "; ".join(f"{name}: {reason}" for name, reason in refusals.items())
        raise ValueError(
            f"no candidate: no schedule of {names} runs {ranks} pipeline ranks with m in {counts} on {layers} layers "
            f"({why or 'every schedule needs more layers than ranks x chunks'}); allow more micro-batch counts "
            "(a batch with more divisors), other schedules, or fewer pipeline ranks"
        )
    candidates.sort(key=lambda c: (c.step_time, max(c.peak_memory)))
    kept = [c for c in candidates if c.fits(memory_limit)]
    dropped = [c for c in candidates if not c.fits(memory_limit)]
    return TuneResult(kept, dropped, memory_limit, time.perf_counter() - started, measured)


def choose(
    config: EngineConfig, model: nn.Sequential, loss_fn: Callable[..., torch.Tensor], sample: object,
    world: Transport,
) -> tuple[EngineConfig, Candidate]:  # fmt: skip
    """schedule="auto": world rank 0 (the first stage's rank) tunes on its sample; every rank gets its choice."""
    choice: Candidate | None = None
    failure = ""
    if world.rank == 0:
        try:
            if sample is None:
                raise ValueError("schedule='auto' needs sample= (an input batch) on the first stage's rank to tune on")
            result = tune(model, loss_fn, sample, world.size, data_parallel=config.data_parallel, fsdp=config.fsdp,  # type: ignore[arg-type]
                          compile=config.compile,
                          microbatches=[config.num_microbatches] if config.num_microbatches else None,
                          memory_limit=config.memory_limit, backend=world.name,
                          device=config.device)  # fmt: skip
            choice = result.best
        except Exception as error:  # noqa: BLE001  (every rank must hear of it)
            failure = f"{type(error).__name__}: {error}"
    (choice, failure), *_ = world.all_gather_object((choice, failure), "the tuned schedule from rank 0")
    if choice is None:
        raise ValueError(f"schedule='auto' could not tune on rank 0: {failure}")
    chosen = dataclasses.replace(config, schedule=choice.schedule, num_microbatches=choice.num_microbatches,
                                 chunks=choice.chunks, partition=choice.partition,
                                 memory_limit=None)  # fmt: skip  # spent: the choice fits under it (a limit beside a
    # named schedule is refused as unread)
    return chosen, choice


def _price(
    name: str, m: int, chunks: int, method: str, bounds: list[tuple[int, int]], program: Schedule,
    profile: LayerProfile, buffered: bool, optimizer_copies: int, overhead: float, latency: float, per_byte: float,
    data_parallel: int, fsdp: bool,
) -> Candidate:  # fmt: skip
    # stage s runs layers bounds[s]; the schedule's stages are in model order
    costs = profile.stage_costs(bounds, overhead=overhead, latency=latency, per_byte=per_byte,
                                optimizer_copies=optimizer_copies, buffered_sends=buffered,
                                placement=program.placement, data_parallel=data_parallel, fsdp=fsdp)  # fmt: skip
    timeline = simulate(program, costs)
    return Candidate(name, m, chunks, (method,), tuple(b - a for a, b in bounds), timeline.makespan,
                     timeline.bubble_fraction, tuple(timeline.required_memory), data_parallel, fsdp)  # fmt: skip


def progress_printer(stream: TextIO | None = None) -> Callable[[int, int, int], None]:
    """A ``tune(progress=)`` that says how far the measuring is, on ``stream`` (default: stderr at each call):
    "measuring 8 layers at 3 micro-batch sizes: 5/24", rewritten in place on a terminal, else a line at the start,
    at each tenth of the way and at the end."""
    shown = -1  # the last tenth written (not on a terminal)

    def report(done: int, layers: int, sizes: int) -> None:
        nonlocal shown
        out = stream if stream is not None else sys.stderr
        total = layers * sizes
        text = f"measuring {layers} layers at {sizes} micro-batch size{'s' if sizes != 1 else ''}: {done}/{total}"
        if out.isatty():
            out.write(f"\r{text}" + ("\n" if done == total else ""))
        elif done * 10 // total > shown:
            shown = done * 10 // total
            out.write(f"{text}\n")
        out.flush()

    return report


def _check_problem(model: object, sample: object, target: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"tune plans an nn.Sequential (the model PipelineEngine cuts into stages), got {type(model).__name__}; "
            "write the model as nn.Sequential(layer, layer, ...)"
        )
    for label, value in (("sample", sample), ("target", target)):
        if label == "target" and value is None:
            continue
        if not (isinstance(value, torch.Tensor) or (isinstance(value, tuple) and value
                                                     and all(isinstance(t, torch.Tensor) for t in value))):  # fmt: skip
            raise TypeError(
                f"{label} must be a batch: a tensor or a tuple of tensors (not a list), got {type(value).__name__}"
            )
        if unpack(value)[0].dim() == 0:
            raise ValueError(f"{label} needs a batch dimension, got a 0-d tensor")


def _mb(value: float | None) -> str:
    """Bytes for people: 512 B, 3.0 KiB, 20.1 MiB, 1.50 GiB."""
    if value is None:
        return "none"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{value:.0f} B"


SIZE_UNITS = ("KiB, MiB, GiB and TiB (or K, M, G and T) are powers of 1024, KB, MB, GB and TB powers of 1000, "
              "B or none bytes")
_SIZE = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*(?:([KMGT])(i?B)?|B)?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """A size -> bytes, positive: '64MiB' and '64M' are 64 x 2**20, '64MB' 64 x 10**6 (as the unit says), '512B'
    and '1.5e9' bytes (SIZE_UNITS)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes with an optional unit, e.g. 512MiB, 2GiB, 2GB or 1.5e9 "
            f"({SIZE_UNITS})"
        )
    number, prefix, suffix = match.groups()
    power = " KMGT".index(prefix.upper()) if prefix else 0
    base = 1000 if suffix is not None and suffix.upper() == "B" else 1024  # KB, MB: SI; KiB, MiB and bare K, M: binary
    value = float(number) * float(base**power)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a memory limit must be positive, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeengine.tune", description=__doc__.split("\n")[0])
    parser.add_argument("problem", help="module:function returning (model, loss_fn, sample): the model to plan for")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true", help="shard each stage's state over the replicas (FSDP2)")
    parser.add_argument("--memory-limit", type=parse_bytes,
                        help=f"bytes per rank, with an optional unit, e.g. 512MiB ({SIZE_UNITS})")
    parser.add_argument("--schedules", nargs="+")
    parser.add_argument("--microbatches", type=int, nargs="+")
    parser.add_argument("--backend", default="gloo", choices=sorted(BACKENDS))
    args = parser.parse_args(_glued(list(sys.argv[1:] if argv is None else argv), ("--memory-limit",)))
    model, loss_fn, sample = _problem(parser, args.problem)
    if args.memory_limit is not None:
        print(f"memory limit {args.memory_limit:,.0f} bytes ({args.memory_limit / 2**20:.2f} MiB) per rank", flush=True)
    try:
        result = tune(model, loss_fn, sample, args.world_size, memory_limit=args.memory_limit,
                      data_parallel=args.data_parallel, fsdp=args.fsdp, schedules=args.schedules,
                      microbatches=args.microbatches, backend=args.backend,
                      progress=progress_printer())  # fmt: skip
        print(result)
        print(f"best: PipelineEngine(model, loss_fn, **{result.best.engine_kwargs()})")
    except (ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _glued(argv: list[str], options: Sequence[str]) -> list[str]:
    """``--memory-limit -5MB`` as ``--memory-limit=-5MB``: argparse would read a value starting with '-' as a flag."""
    out: list[str] = []
    for word in argv:
        if out and out[-1] in options and word.startswith("-"):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def _problem(parser: argparse.ArgumentParser, problem: str) -> tuple[nn.Sequential, Any, Any]:
    """The (model, loss_fn, sample) that module:function returns, or a parser error saying what is wrong."""
    module, _, function = problem.partition(":")
    if not module or not function:
        parser.error(f"problem must be module:function (e.g. examples.train_gpt:planning), got {problem!r}")
    sys.path.insert(0, ".")
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        parser.error(f"cannot import module {module!r} of {problem!r}: {error} (run from the folder it is found in)")
    make = getattr(found, function, None)
    if not callable(make):
        parser.error(f"module {module!r} has no function {function!r}")
    made = make()
    if not isinstance(made, tuple) or len(made) != 3:
        what = f"{len(made)} values" if isinstance(made, tuple) else type(made).__name__
        parser.error(f"{problem}() must return (model, loss_fn, sample), three values; it returned {what}")
    return made


if __name__ == "__main__":
    sys.exit(main())
