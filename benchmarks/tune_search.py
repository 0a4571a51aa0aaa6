"""How long pipeengine.tune takes for a 24-layer model on 2, 4 and 8 ranks: measuring the layers, then the search.

    python benchmarks/tune_search.py                      # the example's GPT with 24 blocks, world sizes 2 4 8
    python benchmarks/tune_search.py --layers 48 --world-sizes 8 16

One process, no ranks: tune() measures every layer once per candidate micro-batch size on the
sample, then prices every candidate with the simulator (schedule x micro-batch count x chunks x
partition method). The search is timed ``--repeats`` times per world size (median; the layers are
measured afresh each time, that time is reported too). Writes out/bench/tune_search.{json,txt}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from common import write_report

from pipeengine.tune import tune

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import train_gpt  # noqa: E402  (the example's GPT, at another depth)

WORLD_SIZES, LAYERS, REPEATS = [2, 4, 8], 24, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks (the model has 2 more layers)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=WORLD_SIZES)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = train_gpt.gpt(args.layers, train_gpt.WIDTH, train_gpt.HEADS, train_gpt.CONTEXT)
    tokens = torch.randint(0, len(train_gpt.VOCAB), (train_gpt.BATCH, train_gpt.CONTEXT))
    rows, lines = [], []
    for world in args.world_sizes:
        results = [
            tune(model, train_gpt.summed_loss, tokens, world, data_parallel=1, checkpoint=["never"])
            for _ in range(args.repeats)
        ]
        search = statistics.median(r.search_seconds for r in results)
        measure = statistics.median(r.measure_seconds for r in results)
        count = len(results[0].rows)
        rows.append(
            {
                "world_size": world,
                "layers": len(model),
                "candidates": count,
                "search_s": search,
                "measure_s": measure,
                "best": results[0].best.engine_kwargs(),
            }
        )
        lines.append(
            f"{world} ranks: {count} candidates priced in {search:.2f} s (median of {args.repeats}), "
            f"after {measure:.2f} s measuring {len(model)} layers; best {results[0].best.schedule} "
            f"m={results[0].best.num_microbatches} v={results[0].best.chunks}"
        )
        print(lines[-1], flush=True)
    write_report("tune_search", rows, lines)


if __name__ == "__main__":
    main()
