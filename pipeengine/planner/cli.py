"""``python -m pipeengine.tune``: the planner on the command line, and the machine's calibration.

python -m pipeengine.tune examples.train_gpt:planning --world-size 4 --memory-limit 64MiB
python -m pipeengine.tune --calibrate --world-size 4
python -m pipeengine.tune --model config.json --devices 512 --hardware a100-80gb --global-batch 1536 --seq 2048
torchrun --nproc-per-node 8 -m pipeengine.tune --calibrate --hardware h100-sxm --out my-gpus.json
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from torch import nn

from pipeengine.comm.backends import BACKENDS
from pipeengine.core.config import CHECKPOINTING
from schedules import SCHEDULES

__all__ = ["SIZE_UNITS", "main", "parse_bytes", "progress_printer"]


def progress_printer(stream: TextIO | None = None) -> Callable[[int, int, int], None]:
    """A ``tune(progress=)`` that says how far the measuring is, on ``stream`` (default: stderr at each call):
    "measuring 8 layers at 3 settings: 5/24" (a setting: a micro-batch size, a tensor-parallel degree, warm or cold;
    pipeengine.planner.search), rewritten in place on a terminal, else a line at the start, at each tenth of the way
    and at the end."""
    shown = -1  # the last tenth written (not on a terminal)

    def report(done: int, layers: int, sizes: int) -> None:
        nonlocal shown
        out = stream if stream is not None else sys.stderr
        total = layers * sizes
        text = f"measuring {layers} layers at {sizes} setting{'s' if sizes != 1 else ''}: {done}/{total}"
        if out.isatty():
            out.write(f"\r{text}" + ("\n" if done == total else ""))
        elif done * 10 // total > shown:
            shown = done * 10 // total
            out.write(f"{text}\n")
        out.flush()

    return report


SIZE_UNITS = (
    "KiB, MiB, GiB and TiB (or K, M, G and T) are powers of 1024, KB, MB, GB and TB powers of 1000, B or none bytes"
)
_SIZE = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*(?:([KMGT])(i?B)?|B)?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """A size -> bytes, positive: '64MiB' and '64M' are 64 x 2**20, '64MB' 64 x 10**6 (as the unit says), '512B'
    and '1.5e9' bytes (SIZE_UNITS)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes with an optional unit, e.g. 512MiB, 2GiB, 2GB or 1.5e9 ({SIZE_UNITS})"
        )
    number, prefix, suffix = match.groups()
    power = " KMGT".index(prefix.upper()) if prefix else 0
    base = 1000 if suffix is not None and suffix.upper() == "B" else 1024  # KB, MB: SI; KiB, MiB and bare K, M: binary
    value = float(number) * float(base**power)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a memory limit must be positive, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None, engine: Callable[..., Any] | None = None) -> int:
    """The command line; ``engine``: PipelineEngine, for --calibrate (pipeengine.tune.main gives it). With --devices:
    a GPU cluster, planned from its description (pipeengine.planner.cluster.cli)."""
    words = list(sys.argv[1:] if argv is None else argv)
    if "--calibrate" in words and any(word == "--hardware" or word.startswith("--hardware=") for word in words):
        from pipeengine.planner.cluster import calibrate  # a hardware description measured on these GPUs

        return calibrate.main(words)
    if any(word == "--devices" or word.startswith("--devices=") for word in words):
        from pipeengine.planner.cluster import cli as cluster

        return cluster.main(words)
    from pipeengine.planner.search import tune

    parser = argparse.ArgumentParser(
        prog="python -m pipeengine.tune",
        description=__doc__.split("\n")[0],
        epilog="A GPU cluster instead: python -m pipeengine.tune --model config.json --devices 512 --hardware "
        "a100-80gb --global-batch 1536 --seq 2048 (its own --help with --devices); a hardware description "
        "measured on your GPUs: torchrun ... -m pipeengine.tune --calibrate --hardware h100-sxm --out FILE",
    )
    parser.add_argument(
        "problem",
        nargs="?",
        help="module:function returning (model, loss_fn, sample) or (model, "
        "loss_fn, sample, tp_plan): the model to plan for",
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks to lay the model out on")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's prices on --world-size "
        "ranks (host time per instruction, messages, collectives) and keep them for the planner",
    )
    parser.add_argument("--data-parallel", type=int, help="fix the replicas (default: searched)")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        help="fix the tensor-parallel degree (default: searched where the problem gives a tp_plan)",
    )
    parser.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        help="fix FSDP on (--fsdp) or off (--no-fsdp); default: both tried where there are replicas",
    )
    parser.add_argument(
        "--checkpoint",
        nargs="+",
        choices=CHECKPOINTING,
        default=list(CHECKPOINTING),
        help="the checkpoint options to try",
    )
    parser.add_argument(
        "--memory-limit", type=parse_bytes, help=f"bytes per rank, with an optional unit, e.g. 512MiB ({SIZE_UNITS})"
    )
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), help="the schedules to try (default: all)")
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        help="the micro-batch counts to try (default: each that divides a replica's batch, up to 64)",
    )
    parser.add_argument("--backend", default="gloo", choices=sorted(BACKENDS), help="the transport that will run it")
    args = parser.parse_args(_glued(list(sys.argv[1:] if argv is None else argv), ("--memory-limit",)))
    if args.calibrate:
        from pipeengine.planner.calibration import measure_machine

        if args.world_size < 2:
            parser.error(
                f"--calibrate times messages and collectives between ranks: --world-size 2 or more, got "
                f"{args.world_size}"
            )
        print(f"calibrating on {args.world_size} {args.backend} ranks ...", flush=True)
        if engine is None:
            parser.error("--calibrate runs the engine: use python -m pipeengine.tune")
        path, prices = measure_machine(args.world_size, engine, args.backend)
        sharing = (
            "each rank computes at full speed"
            if prices.processors is None
            else f"{prices.processors:.2f} ranks compute at full speed at once"
        )
        frame = ", ".join(
            f"{name} of {group} {seconds * 1e3:.2f} ms"
            for name, sizes in prices.frame.items()
            for group, seconds in sorted(sizes.items())
        )
        print(
            f"wrote {path}: host {prices.overhead * 1e3:.3f} ms per compute, a post {prices.post * 1e3:.3f} ms, a "
            f"message {prices.p2p.latency * 1e3:.3f} ms + {prices.p2p.per_byte * 2**30:.3f} s/GiB; a step's frame: "
            f"{frame}; {sharing}"
        )
        return 0
    if args.problem is None:
        parser.error("give the problem (module:function), or --calibrate")
    model, loss_fn, sample, *plan = _problem(parser, args.problem)
    if args.memory_limit is not None:
        print(f"memory limit {args.memory_limit:,.0f} bytes ({args.memory_limit / 2**20:.2f} MiB) per rank", flush=True)
    try:
        result = tune(
            model,
            loss_fn,
            sample,
            args.world_size,
            memory_limit=args.memory_limit,
            data_parallel=args.data_parallel,
            tensor_parallel=args.tensor_parallel,
            tp_plan=plan[0] if plan else None,
            fsdp=args.fsdp,
            checkpoint=args.checkpoint,
            schedules=args.schedules,
            microbatches=args.microbatches,
            backend=args.backend,
            progress=progress_printer(),
        )
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


def _problem(parser: argparse.ArgumentParser, problem: str) -> tuple[nn.Sequential, Any, Any] | tuple[Any, ...]:
    """The (model, loss_fn, sample[, tp_plan]) that module:function returns, or a parser error saying what is wrong."""
    module, _, function = problem.partition(":")
    if not module or not function:
        parser.error(f"problem must be module:function (e.g. examples.train_gpt:planning), got {problem!r}")
    sys.path.insert(0, os.getcwd())  # this folder, as it is now (a cached "." may name another)
    importlib.invalidate_caches()
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        parser.error(f"cannot import module {module!r} of {problem!r}: {error} (run from the folder it is found in)")
    make = getattr(found, function, None)
    if not callable(make):
        parser.error(f"module {module!r} has no function {function!r}")
    made = make()
    if not isinstance(made, tuple) or len(made) not in (3, 4):
        what = f"{len(made)} values" if isinstance(made, tuple) else type(made).__name__
        parser.error(
            f"{problem}() must return (model, loss_fn, sample) or (model, loss_fn, sample, tp_plan); it returned {what}"
        )
    return made
