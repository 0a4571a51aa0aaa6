"""The cluster planner against published runs: Narayanan et al. 2021 (SC21), Table 1, priced from a laptop.

    python benchmarks/cluster_plan.py                  # the ten rows of Table 1 on their A100-80GB cluster, then
                                                       # the search for the 1T model's 3072 GPUs
    python benchmarks/cluster_plan.py --hardware h100-sxm --rows 1 5     # those layouts on another machine

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1 (weak scaling; the
figures in shared/data/megatron_sc21_table1.csv, which the repository's CI copy keeps beside the checkout): GPT
models of 1.7B to 1T parameters on 32 to 3072 A100-80GB GPUs, 8 a node on NVSwitch, 8 x 200 Gb/s InfiniBand a node,
fp16, full activation recomputation, the paper's tensor-, pipeline- and data-parallel sizes, micro-batch and
interleaved chunks. Each row's layout is priced by pipeengine.planner.cluster.layout.price on the A100-80GB
preset (datasheet and measured figures, never fitted to this table: it is a check, not training data), and its
predicted TFLOP/s per GPU (the paper's count of FLOPs, recomputation included, over the predicted step) is set
beside the paper's.

The model is the paper's: a GPT block as Megatron-LM ran it in 2021 (its attention unfused: a score matrix of
s x s per head, a fused scale-mask-softmax, dropout; fused bias-GeLU), traced on the meta device at each tensor-
parallel rank's shapes (heads / t, 4h / t). Writes out/bench/cluster_plan.{json,txt,png}.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import statistics
import time
from pathlib import Path

import torch
from common import OUT, write_report
from torch import nn
from torch.nn import functional as F

from pipeengine.planner.cluster import Hardware, load
from pipeengine.planner.cluster.costs import Op, trace
from pipeengine.planner.cluster.layout import Layout, Runtime, Transformer, price
from pipeengine.planner.cluster.search import search

TABLE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "megatron_sc21_table1.csv"


class Block(nn.Module):
    """One tensor-parallel rank's part of a GPT block as Megatron-LM 2021 computes it: inputs [s, b, h]."""

    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b * self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [b * heads, s, d]
        scores = torch.baddbmm(
            torch.empty(b * self.heads, s, s, dtype=x.dtype, device=x.device),
            q,
            k.transpose(1, 2),
            beta=0.0,
            alpha=1 / math.sqrt(self.head_dim),
        )
        probs = F.dropout(torch.softmax(scores, dim=-1), 0.1)  # the fused scale-mask-softmax: one read, one write
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, self.heads * self.head_dim)
        x = x + F.dropout(self.proj(context), 0.1)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))), 0.1)


class Ends(nn.Module):
    """The embedding (tokens and positions) and the head tied to it, vocabulary-parallel, and the loss."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions.weight  # [b, s, h]
        logits = self.norm(x) @ self.tokens.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> Transformer:
    """Narayanan et al.'s GPT, its blocks and ends traced on the meta device per (tp, micro-batch)."""

    @functools.cache
    def block_ops(tp: int, micro_batch: int) -> list[Op]:
        with torch.device("meta"):
            block = Block(hidden, heads // tp, hidden // heads, 4 * hidden // tp).half()
            x = torch.empty(seq, micro_batch, hidden, dtype=torch.float16, requires_grad=True)
        return trace(block, x)

    @functools.cache
    def head_ops(tp: int, micro_batch: int) -> list[Op]:
        with torch.device("meta"):
            ends = Ends(vocab // tp, hidden, seq).half()
            tokens = torch.zeros(micro_batch, seq, dtype=torch.int64)
        return trace(ends, tokens, tokens)

    parameters = 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))
    return Transformer(layers, hidden, heads, seq, vocab, parameters, block_ops, head_ops)


def megatron_2021(pp: int) -> Runtime:
    """How Megatron-LM ran each row (examples/academic_paper_scripts/sc21/run_table_1.sh): ``--DDP-impl torch``
    where there is no pipeline (the 1.7B to 18.4B rows: torch's DistributedDataParallel, its all-reduce overlapped
    with the backward in 25 MB buckets), ``local`` elsewhere (megatron/model/distributed.py at b4bc51b, March 2021:
    an all-reduce after the backward). Either accumulates a micro-batch's fp16 gradients into the kept ones
    (autograd's AccumulateGrad: read both, write one); the fused accumulation came later."""
    return Runtime(overlap_grad_reduce=pp == 1, accumulate_bytes=6.0)


def rows() -> list[dict[str, float]]:
    with open(TABLE) as source:
        lines = [line for line in source if not line.startswith("#")]
    return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(lines)]


def searched(row: dict[str, float], hw: Hardware) -> str:
    """The search over every layout of the row's model on its devices and global batch: its time, its best row, and
    the paper's layout priced the same way."""
    started = time.perf_counter()
    model = gpt(int(row["layers"]), int(row["hidden"]), int(row["heads"]), 2048, 51200)
    plan = search(model, int(row["gpus"]), hw, int(row["global_batch"]), runtime=megatron_2021(int(row["p"])))
    seconds = time.perf_counter() - started
    best = plan.best
    paper = price(
        model,
        Layout(
            int(row["t"]),
            int(row["p"]),
            int(row["d"]),
            int(row["micro_batch"]),
            int(row["m"]),
            "interleaved" if row["v"] > 1 else "1f1b",
            int(row["v"]),
            True,
        ),
        hw,
        runtime=megatron_2021(int(row["p"])),
    )
    return (
        f"search: {row['params_b']:.0f}B on {int(row['gpus'])} GPUs, {plan.considered} layouts in {seconds:.1f} s "
        f"(tracing included), {len(plan.refused)} past the memory; best {best.layout.describe()} "
        f"{best.tflops_per_device:.1f} TFLOP/s a GPU at {best.peak_bytes / 2**30:.1f} GiB, the paper's layout "
        f"{paper.tflops_per_device:.1f} ({best.step_s / paper.step_s - 1:+.1%} step)"
    )


def plot(table: list[dict[str, object]], path: Path, title: str) -> None:
    """The paper's TFLOP/s a GPU beside the predicted, row by row, each bar pair labelled with its error."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    places = range(len(table))
    paper = [float(row["paper_tflops"]) for row in table]  # type: ignore[arg-type]
    predicted = [float(row["predicted_tflops"]) for row in table]  # type: ignore[arg-type]
    axis.bar([i - 0.2 for i in places], paper, width=0.4, label="paper (SC21, Table 1)", color="#8C8C8C")
    axis.bar([i + 0.2 for i in places], predicted, width=0.4, label="predicted", color="#4C72B0")
    for i, row in zip(places, table, strict=True):
        axis.annotate(f"{float(row['error']):+.1%}", (i + 0.2, predicted[i]), ha="center", va="bottom", fontsize=8)  # type: ignore[arg-type]
    axis.set_xticks(list(places), [f"{row['params_b']}B\n{row['gpus']} GPUs" for row in table], fontsize=8)
    axis.set_ylabel("TFLOP/s a GPU")
    axis.set_ylim(0, max(paper + predicted) * 1.15)
    axis.set_title(title, fontsize=10, loc="left")
    axis.legend(fontsize=8, loc="lower right")
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--rows", type=int, nargs="+", help="only these rows of the table (1 to 10)")
    args = parser.parse_args()
    hw = load(args.hardware)
    table, lines, errors = [], [], []
    for number, row in enumerate(rows(), 1):
        if args.rows and number not in args.rows:
            continue
        started = time.perf_counter()
        model = gpt(int(row["layers"]), int(row["hidden"]), int(row["heads"]), 2048, 51200)
        v = int(row["v"])
        layout = Layout(
            int(row["t"]),
            int(row["p"]),
            int(row["d"]),
            int(row["micro_batch"]),
            int(row["m"]),
            "interleaved" if v > 1 else "1f1b",
            v,
            recompute=True,
        )
        priced = price(model, layout, hw, runtime=megatron_2021(layout.pp))
        error = priced.tflops_per_device / row["tflops_per_gpu"] - 1
        errors.append(abs(error))
        table.append(
            {
                "params_b": row["params_b"],
                "gpus": int(row["gpus"]),
                "layout": layout.describe(),
                "paper_tflops": row["tflops_per_gpu"],
                "predicted_tflops": round(priced.tflops_per_device, 1),
                "error": round(error, 4),
                "step_s": round(priced.step_s, 3),
                "peak_gib": round(priced.peak_bytes / 2**30, 1),
                "parts": {k: round(x, 3) for k, x in priced.parts.items()},
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        lines.append(
            f"{row['params_b']:>7}B on {int(row['gpus']):>4} GPUs, {layout.describe()}: predicted "
            f"{priced.tflops_per_device:6.1f} TFLOP/s a GPU, paper {row['tflops_per_gpu']:.0f} ({error:+.1%}),"
            f" step {priced.step_s:.2f} s, peak {priced.peak_bytes / 2**30:.1f} GiB"
        )
        print(lines[-1], flush=True)
    lines.append(
        f"{hw.name}: |error| median {statistics.median(errors):.1%}, largest {max(errors):.1%} over {len(errors)} rows"
    )
    print(lines[-1])
    if not args.rows:  # the search for the last row's cluster, against the paper's own layout of it
        lines.append(searched(rows()[-1], hw))
        print(lines[-1])
    write_report("cluster_plan", table, lines)
    plot(table, OUT / "cluster_plan.png", lines[len(table)])
    print(f"wrote {OUT}/cluster_plan.*")


if __name__ == "__main__":
    main()
