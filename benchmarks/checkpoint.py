"""What a checkpoint costs the training: the stall of engine.save(background=True) against a synchronous save.

    python benchmarks/checkpoint.py                  # 2 CPU ranks, pp=2: 9 x Linear(1024) and AdamW, 108 MiB of state
    python benchmarks/checkpoint.py --fsdp 1         # dp=2 with fsdp=True: the sharded format (DCP)

Per round, alternating: a synchronous save (its time, barrier to the slowest rank, is the stall it causes); a
background save (the stall: until save() returns, with the state copied) and the step that runs while it is written;
the wait for that write to complete; and a step with no write beside it. Medians over --rounds. The state is the
model's weights and AdamW's two moments (after one step), written whole (pp=2) or as shards (fsdp). Writes
out/bench/checkpoint.json and .txt.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import median, mlp, run_point, save_row, timed, write_report

from pipeengine import PipelineEngine
from pipeengine.core.dtensors import local

WIDTH, LAYERS, BATCH, ROUNDS = 1024, 9, 64, 5


def worker(args: argparse.Namespace, directory: str, path: str) -> None:
    options = {"data_parallel": 2, "fsdp": True} if args.fsdp else {}
    engine = PipelineEngine(
        mlp(args.width, args.layers), torch.nn.functional.mse_loss, num_microbatches=2, partition="uniform", **options
    )  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)

    def step() -> None:
        engine.train_step(x if engine.first else None, y if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()

    step()  # AdamW's moments exist
    state = sum(
        local(t).numel() * t.element_size()
        for p in engine.parameters()
        for t in [p, *(v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim())]
    )
    total = torch.tensor([float(state)])
    torch.distributed.all_reduce(total)
    sync, stall, overlapped, complete, plain = [], [], [], [], []
    pending: list[object] = []

    def start() -> None:
        pending.append(engine.save(directory, optimizer, background=True))

    for _ in range(args.rounds):
        sync.append(timed(lambda: engine.save(directory, optimizer)))
        stall.append(timed(start))
        overlapped.append(timed(step))  # the step the write runs beside
        complete.append(timed(lambda: pending.pop().result()))  # type: ignore[attr-defined]
        plain.append(timed(step))
    if torch.distributed.get_rank() == 0:
        save_row(
            path,
            {
                "format": "sharded (fsdp, dp=2)" if args.fsdp else "whole tensors (pp=2)",
                "state_mib": total.item() / 2**20,
                "sync_save_ms": 1e3 * median(sync),
                "background_stall_ms": 1e3 * median(stall),
                "stall_fraction": median(stall) / median(sync),
                "step_ms": 1e3 * median(plain),
                "step_with_write_ms": 1e3 * median(overlapped),
                "write_left_after_step_ms": 1e3 * median(complete),
                "rounds": args.rounds,
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("width", WIDTH), ("layers", LAYERS), ("batch", BATCH), ("rounds", ROUNDS), ("fsdp", 0)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--dir", help="where the checkpoints are written (default: the system's temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        row = run_point(worker, 2, (args, directory), threads=1)
    lines = [
        f"{row['format']}: {row['state_mib']:.0f} MiB of state (weights and AdamW's moments), "  # type: ignore[index]
        f"medians of {args.rounds} rounds",
        f"  synchronous save      {row['sync_save_ms']:8.1f} ms stall",  # type: ignore[index]
        f"  background=True       {row['background_stall_ms']:8.1f} ms stall "  # type: ignore[index]
        f"({row['stall_fraction']:.1%} of the synchronous save)",  # type: ignore[index]
        f"  a step                {row['step_ms']:8.1f} ms alone, {row['step_with_write_ms']:.1f} ms beside "  # type: ignore[index]
        f"the write, which then needed {row['write_left_after_step_ms']:.1f} ms more",
    ]  # type: ignore[index]
    print("\n".join(lines))
    write_report("checkpoint_fsdp" if args.fsdp else "checkpoint", [row], lines)


if __name__ == "__main__":
    main()
