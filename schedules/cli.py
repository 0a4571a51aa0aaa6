"""Command line: show, validate and simulate schedules without torch.

python -m schedules show 1f1b --ranks 4 --microbatches 8
python -m schedules validate interleaved --ranks 4 --microbatches 8 --chunks 2
python -m schedules simulate gpipe --ranks 4 --microbatches 8 --backward 3
python -m schedules plot zb-h1 -p 4 -m 8                        # writes out/zb-h1.png (-o FILE: elsewhere)
python -m schedules show 1f1b -p 2 -m 4 --text -o out/mine.txt  # edit it, then:
python -m schedules validate out/mine.txt                       # a schedule file (Schedule.to_text's form)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from schedules.compilers.registry import SCHEDULES, build_schedule, compile_schedule
from schedules.ir.schedule import Schedule, ScheduleError
from schedules.passes.lowering import lowered
from schedules.proof.validation import validate
from schedules.sim.memory_model import Memory
from schedules.sim.simulation import Costs, simulate

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m schedules", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", help=f"a schedule name ({', '.join(SCHEDULES)}) or a schedule file")
    common.add_argument("--ranks", "-p", type=int, help="pipeline ranks (with a name)")
    common.add_argument("--microbatches", "-m", type=int, help="micro-batches per step (with a name)")
    common.add_argument("--chunks", "-v", type=int, help="stages per rank (default: the schedule's own)")
    show = verbs.add_parser("show", parents=[common], help="print the per-rank instruction grid")
    show.add_argument("--compute-only", action="store_true", help="the compiler's order, before lowering")
    show.add_argument("--text", action="store_true", help="the whole schedule as text (Schedule.from_text reads it)")
    show.add_argument("-o", "--output", help="write it to this file (making its folders) instead of printing it")
    verbs.add_parser("validate", parents=[common], help="prove the schedule's invariants")
    sim = verbs.add_parser("simulate", parents=[common], help="simulate with a cost model")
    for flag, default, text in [
        ("--forward", 1.0, "forward time per stage"),
        ("--backward", None, "full backward time (default: backward-input + backward-weight)"),
        ("--backward-input", 1.0, "input-gradient time"),
        ("--backward-weight", 1.0, "weight-gradient time"),
        ("--latency", 0.0, "time per message"),
    ]:
        sim.add_argument(flag, type=float, default=default, help=f"{text} (default {default})")
    sim.add_argument("--diagram", action="store_true", help="print the text Gantt chart (needs integral costs)")
    sim.add_argument(
        "--memory",
        action="store_true",
        help="print each rank's peak memory (a micro-batch's activation on a stage counts 1)",
    )
    plot = verbs.add_parser("plot", parents=[common], help="draw the simulated timeline (unit costs) as a PNG")
    plot.add_argument("-o", "--output", help="PNG file to write, its folders made (default: out/<schedule>.png)")
    return parser


def _schedule(args: argparse.Namespace, lowered_form: bool = True) -> Schedule:
    """The schedule the arguments name: a registered schedule compiled (and lowered), or a file (lowered if it holds
    compute only, as the engine does)."""
    if args.name not in SCHEDULES and Path(args.name).is_file():
        schedule = Schedule.from_text(Path(args.name).read_text())
        given = {
            "--ranks": (args.ranks, schedule.num_ranks),
            "--microbatches": (args.microbatches, schedule.num_microbatches),
            "--chunks": (args.chunks, schedule.chunks),
        }
        clash = [
            f"{flag} {mine} (the file: {theirs})"
            for flag, (mine, theirs) in given.items()
            if mine is not None and mine != theirs
        ]
        if clash:
            raise ValueError(
                f"{args.name} is a schedule file, which fixes its own sizes, but {', '.join(clash)}: drop the flags "
                "(they size a named schedule), or edit the file"
            )
        return lowered(schedule) if lowered_form else schedule
    if args.ranks is None or args.microbatches is None:
        raise ValueError(
            f"{args.name!r} is {'a schedule name' if args.name in SCHEDULES else 'neither a schedule name nor a file'}"
            f"; a name needs --ranks and --microbatches (names: {', '.join(SCHEDULES)})"
        )
    build = build_schedule if lowered_form else compile_schedule
    return build(args.name, args.ranks, args.microbatches, args.chunks)


def _writable(path: str) -> Path:
    """The path, its missing folders made."""
    where = Path(path)
    where.parent.mkdir(parents=True, exist_ok=True)
    return where


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "show":
            schedule = _schedule(args, lowered_form=not args.compute_only)
            text = schedule.to_text() if args.text else f"{schedule}\n"
            if args.output is None:
                print(text, end="")
            else:
                _writable(args.output).write_text(text)
                print(f"wrote {args.output}")
        elif args.verb == "validate":
            start = time.perf_counter()
            schedule = _schedule(args)
            validate(schedule)
            count = sum(len(stream) for stream in schedule.instructions)
            print(
                f"valid: {schedule.describe()}; {count} instructions "
                f"(built and validated in {time.perf_counter() - start:.2f} s)"
            )
        elif args.verb == "plot":
            schedule = _schedule(args)
            output = args.output or str(Path("out") / f"{Path(args.name).stem}.png")
            simulate(schedule).plot(str(_writable(output)), title=schedule.describe())
            print(f"wrote {output}")
        else:
            schedule = _schedule(args)
            costs = Costs(
                args.forward,
                args.backward,
                args.backward_input,
                args.backward_weight,
                args.latency,
                memory=Memory() if args.memory else None,
            )
            timeline = simulate(schedule, costs)
            print(schedule.describe())
            print(timeline.summary())
            if args.diagram:
                print(timeline.diagram())
    except ScheduleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:  # OSError: a file it cannot write (or read)
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
