"""Command line: show, validate and simulate schedules without torch.

python -m schedules show 1f1b --ranks 4 --microbatches 8
python -m schedules validate interleaved --ranks 4 --microbatches 8 --chunks 2
python -m schedules simulate gpipe --ranks 4 --microbatches 8 --backward 3
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from schedules.registry import SCHEDULES, build_schedule, compile_schedule
from schedules.schedule import ScheduleError
from schedules.simulation import Costs, simulate
from schedules.validation import validate

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m schedules", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", choices=sorted(SCHEDULES), help="schedule name")
    common.add_argument("--ranks", "-p", type=int, required=True, help="pipeline ranks")
    common.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step")
    common.add_argument("--chunks", "-v", type=int, default=1, help="stages per rank (interleaved)")
    show = verbs.add_parser("show", parents=[common], help="print the per-rank instruction grid")
    show.add_argument("--compute-only", action="store_true", help="the compiler's order, before lowering")
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
    plot = verbs.add_parser("plot", parents=[common], help="draw the simulated timeline (unit costs) as a PNG")
    plot.add_argument("-o", "--output", required=True, help="PNG file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "show":
            build = compile_schedule if args.compute_only else build_schedule
            print(build(args.name, args.ranks, args.microbatches, args.chunks))
        elif args.verb == "validate":
            start = time.perf_counter()
            schedule = build_schedule(args.name, args.ranks, args.microbatches, args.chunks)
            validate(schedule)
            count = sum(len(stream) for stream in schedule.instructions)
            print(
                f"valid: {schedule.describe()}; {count} instructions "
                f"(built and validated in {time.perf_counter() - start:.2f} s)"
            )
        elif args.verb == "plot":
            schedule = build_schedule(args.name, args.ranks, args.microbatches, args.chunks)
            simulate(schedule).plot(args.output, title=schedule.describe())
            print(f"wrote {args.output}")
        else:
            schedule = build_schedule(args.name, args.ranks, args.microbatches, args.chunks)
            costs = Costs(args.forward, args.backward, args.backward_input, args.backward_weight, args.latency)
            timeline = simulate(schedule, costs)
            print(schedule.describe())
            print(timeline.summary())
            if args.diagram:
                print(timeline.diagram())
    except ScheduleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
