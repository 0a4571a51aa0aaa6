"""Sharded data parallel inside the pipeline, side by side with torch.distributed.pipelining: dp=2 x pp=2, 4 gloo ranks.

    python benchmarks/vs_torch_fsdp.py                    # 1f1b and gpipe, the benchmark MLP, with and without FSDP
    python benchmarks/vs_torch_fsdp.py --schedules 1f1b --rounds 9

torch's side is torchtitan's recipe over the same stages (the layers this engine's partition gives the
rank): with FSDP, fully_shard on each layer of the stage module and on the module, reshard_after_forward=False,
over the mesh's data-parallel dim; without it, DistributedDataParallel over the same replicas; then a
PipelineStage over the pipeline group and torch's schedule, which toggles FSDP's flags per micro-batch and
reduce-scatters once per step. This engine runs fsdp=True (or data_parallel alone). Both start from the same
weights, each replica on its own batch; their losses are checked equal, then they are timed in alternating
rounds (medians) so both see the same machine, and each rank's peak in a step is watched by the allocator
(what was live at its start, plus the most it allocated). Reports the step-time ratio (torch / pipeengine:
above 1.0, this engine is faster) and the peaks. Writes out/bench/vs_torch_fsdp.{json,txt}.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from common import (
    arguments,
    mlp,
    run_point,
    save_row,
    side_by_side,
    side_by_side_line,
    time_and_watch,
    write_report,
)
from torch import nn

from pipeengine import PipelineEngine

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, ROUNDS, STEPS = 4, 1, 1024, 8, 128, 8, 7, 2
SCHEDULES = ["gpipe", "1f1b"]
DP = 2


def torch_pipeline(
    schedule: str, engine: PipelineEngine, model: nn.Sequential, fsdp: bool, args: argparse.Namespace
) -> object:
    """torchtitan's recipe over the same stage: fully_shard each layer and the stage (or DDP), then PipelineStage."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    from pipeengine.core.bounds import stage_module

    stage = engine.pp_rank
    module: nn.Module = stage_module(model, *engine.bounds[stage])
    if fsdp:
        dp = engine.mesh["dp"]  # type: ignore[index]
        for layer in module.children():
            fully_shard(layer, mesh=dp, reshard_after_forward=False)
        fully_shard(module, mesh=dp, reshard_after_forward=False)
    else:  # the engine's replica group
        module = DistributedDataParallel(
            module,
            process_group=engine.topology.data.group,  # type: ignore[union-attr]
            static_graph=True,
        )  # its bucket rebuild fails under several micro-batches
    pipe = PipelineStage(module, stage, len(engine.bounds), torch.device("cpu"), group=engine.group)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        pipe, args.microbatches, loss_fn=nn.functional.mse_loss
    )


def worker(schedule: str, fsdp: bool, args: argparse.Namespace, path: str) -> None:
    model = mlp(args.width, args.layers)
    theirs_model = copy.deepcopy(model)
    engine = PipelineEngine(
        model,
        nn.functional.mse_loss,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
        data_parallel=DP,
        fsdp=fsdp,
    )
    generator = torch.Generator().manual_seed(1 + engine.dp_rank)  # each replica its own batch
    x, y = (
        torch.randn(args.batch, args.width, generator=generator),
        torch.randn(args.batch, args.width, generator=generator),
    )
    theirs = torch_pipeline(schedule, engine, theirs_model, fsdp, args)
    mine = list(engine.parameters())
    their_params = list(theirs._stage.submod.parameters())  # type: ignore[attr-defined]

    ours, torch_step = side_by_side(engine, theirs, x, y, engine.first, engine.last)

    ours_loss, their_loss = ours(), torch_step()
    replicas = [None] * dist.get_world_size()
    dist.all_gather_object(replicas, their_loss)
    their_mean = sum(r for r in replicas if r is not None) / DP  # type: ignore[misc]
    if abs(ours_loss - their_mean) > 1e-4 * abs(ours_loss):
        raise AssertionError(f"{schedule} fsdp={fsdp}: the loss {ours_loss} differs from torch's {their_mean}")
    row = time_and_watch(ours, torch_step, mine, their_params, args.rounds, args.steps)
    if dist.get_rank() == 0:
        save_row(path, {"schedule": schedule, "fsdp": fsdp, **row})


def main() -> None:
    parser = arguments(
        __doc__,
        SCHEDULES,
        choices=True,
        width=WIDTH,
        layers=LAYERS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        rounds=ROUNDS,
        steps=STEPS,
        threads=THREADS,
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["fsdp", "ddp"],
        choices=["fsdp", "ddp"],
        help="fsdp: both sides shard (FSDP2); ddp: both replicate (no fsdp; torch's DDP)",
    )
    args = parser.parse_args()
    rows, lines = [], []
    for fsdp in [mode == "fsdp" for mode in args.modes]:
        for schedule in args.schedules:
            row = run_point(worker, RANKS, (schedule, fsdp, args), args.threads)
            rows.append(row)
            line = side_by_side_line(f"{schedule:6} {'fsdp' if fsdp else 'ddp ':4}", row)
            lines.append(line)
            print(line, flush=True)
    write_report("vs_torch_fsdp", rows, lines)


if __name__ == "__main__":
    main()
