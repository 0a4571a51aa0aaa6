"""``python -m pipeengine.tune --devices N ...``: a layout for a model on a GPU cluster, planned from this machine.

    python -m pipeengine.tune --model config.json --devices 512 --devices-per-node 8 --hardware a100-80gb \\
        --global-batch 1536 --seq 2048 [--precision bf16|fp16] [--recompute always|never|search]
        [--fsdp always|never|search] [--json rows.json]
    python -m pipeengine.tune --model config.json --devices 512 --hardware h100-sxm --global-batch 1536 --seq 2048 \\
        --fix tp=8,pp=2,dp=32,micro_batch=4,schedule=1f1b,chunks=1

``--model``: a Hugging Face config.json (the model is described from it on the meta device, nothing allocated), or
module:function returning a transformers config, a pipeengine.planner.cluster.layout.Transformer, or the problem the
planner on this machine takes, (model, loss_fn, sample[, tp_plan]) with model any nn.Sequential (priced layer by layer:
pipeengine.planner.cluster.sequential; its tp_plan is not, tp stays 1). ``--hardware``:
a preset (a100-80gb, h100-sxm, h200) or a hardware description's JSON file. Prints the ranked rows and writes a
plot of where each row's step goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeengine.planner.cluster.hardware import PRESETS, load
from pipeengine.planner.cluster.layout import Layout, Model, Price, Transformer, check, price, readable_bytes
from pipeengine.planner.cluster.search import search
from pipeengine.planner.cluster.sequential import Sequential

__all__ = ["main"]

FIXED = ("tp", "pp", "dp", "micro_batch")  # what --fix must name; schedule, chunks and recompute may follow


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(prog="python -m pipeengine.tune", description=__doc__.split("\n")[0])
    made.add_argument(
        "--model",
        required=True,
        help="a Hugging Face config.json, or module:function (returning a "
        "config, or (model, loss_fn, sample) with an nn.Sequential)",
    )
    made.add_argument("--devices", type=int, required=True, help="GPUs in all")
    made.add_argument("--devices-per-node", type=int, help="GPUs a node (default: the hardware's)")
    made.add_argument("--hardware", default="a100-80gb", help=f"one of {', '.join(PRESETS)}, or a JSON file")
    made.add_argument("--global-batch", type=int, required=True, help="sequences a step, all replicas together")
    made.add_argument("--seq", type=int, required=True, help="tokens a sequence")
    made.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    made.add_argument("--recompute", choices=("always", "never", "search"), default="search")
    made.add_argument(
        "--fsdp",
        choices=("always", "never", "search"),
        default="search",
        help="the replicas shard the weights and optimizer state (FSDP2), copy them, or either",
    )
    made.add_argument(
        "--fix",
        help="price this one layout: tp=8,pp=2,dp=32,micro_batch=4[,schedule=1f1b,chunks=1,"
        "recompute=always,fsdp=never]",
    )
    made.add_argument(
        "--max-micro-batch",
        type=int,
        help="the largest micro-batch searched (default: 16 sequences "
        "for a transformer, a replica's whole batch for an nn.Sequential)",
    )
    made.add_argument("--json", type=Path, help="write the rows here")
    made.add_argument("--plot", type=Path, default=Path("out/plan/cluster_plan.png"), help="where the plot goes")
    return made


def main(argv: Sequence[str] | None = None) -> int:
    made = parser()
    args = made.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        for name in ("devices", "global_batch", "seq"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a whole number, 1 or more")
        hw = load(args.hardware)
        if args.devices_per_node is not None:
            hw = dataclasses.replace(hw, devices_per_node=args.devices_per_node)
        if args.devices > hw.devices_per_node and args.devices % hw.devices_per_node:
            raise ValueError(
                f"--devices {args.devices} is not whole nodes of {hw.devices_per_node} devices: give a "
                f"multiple of {hw.devices_per_node} (or --devices-per-node to match your nodes)"
            )
        model = _model(args.model, args.seq, args.precision)
        if args.fix:
            layout = _fixed(args.fix, args.global_batch, args.recompute, args.fsdp)
            if layout.devices != args.devices:
                raise ValueError(
                    f"--fix lays out tp x pp x dp = {layout.devices} devices, --devices is "
                    f"{args.devices}: make them agree"
                )
            check(model, layout, hw)
            rows, said = [price(model, layout, hw, args.precision)], f"{layout.describe()} priced"
        else:
            plan = search(
                model,
                args.devices,
                hw,
                args.global_batch,
                recompute=args.recompute,
                dtype=args.precision,
                fsdp=args.fsdp,
                max_micro_batch=args.max_micro_batch,
            )
            rows = plan.rows
            said = (
                f"{plan.considered} layouts considered in {plan.seconds:.2f} s, {len(plan.refused)} refused "
                "(past the device's memory, or a micro-batch size the model fails at), the best "
                f"{len(rows)} replayed"
            )
            if not rows:
                plan.best  # noqa: B018  (raises, saying the smallest need against the device's memory)
    except (ValueError, TypeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{hw.name}, {args.devices} devices ({hw.devices_per_node} a node), {model.layers} layers, "
        f"{_count(model.parameters)} parameters, {args.global_batch} x {args.seq} tokens a step: {said}"
    )
    for row in rows:
        print(_line(row))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([_record(row) for row in rows], indent=1))
    if rows:
        _plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _model(spec: str, seq: int, precision: str = "bf16") -> Model:
    from pipeengine.planner.cluster.models import from_config, load_config

    if spec.endswith(".json"):
        return from_config(load_config(spec), seq)
    module, _, function = spec.partition(":")
    if not module or not function:
        raise ValueError(f"--model must be a config.json or module:function, got {spec!r}")
    sys.path.insert(0, os.getcwd())  # this folder, as it is now (a cached "." may name another)
    importlib.invalidate_caches()
    try:
        made = getattr(importlib.import_module(module), function)()
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"--model {spec}: {type(error).__name__}: {error}; name an importable module and a function "
            "in it (run from the folder it imports from)"
        ) from error
    if isinstance(made, Transformer):
        return made
    if hasattr(made, "num_hidden_layers"):
        return from_config(made, seq)
    if isinstance(made, tuple) and len(made) in (3, 4):
        if not isinstance(made[0], nn.Sequential):
            raise TypeError(
                f"{spec}() returned (model, loss_fn, sample) with a {type(made[0]).__name__} for the "
                "model: the cluster planner takes an nn.Sequential (its layers, the pipeline's to cut)"
            )
        if len(made) == 4:
            print(
                "note: the tp_plan is not priced on clusters: a generic nn.Sequential is planned at tp=1",
                file=sys.stderr,
            )
        return Sequential(made[0], made[2], seq, torch.float16 if precision == "fp16" else torch.bfloat16)
    if isinstance(made, nn.Sequential):
        raise TypeError(
            f"{spec}() returned the model alone: return (model, loss_fn, sample), sample one batch whose "
            "first dimension is the rows (only its shapes are read)"
        )
    raise TypeError(
        f"{spec}() returned {type(made).__name__!r}: return a transformers config, a Transformer, or "
        "(model, loss_fn, sample[, tp_plan]) as for the planner on this machine, model an nn.Sequential "
        "(build a large one under `with torch.device('meta'):`)"
    )


def _fixed(text: str, global_batch: int, recompute: str = "search", fsdp: str = "search") -> Layout:
    """The layout --fix names; recompute and fsdp it leaves out follow --recompute and --fsdp where those say always
    or never, else recompute=always and fsdp=never."""
    fields: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--fix {text!r}: {part!r} is not key=value")
        fields[key.strip()] = value.strip()
    missing = [key for key in FIXED if key not in fields]
    unknown = sorted(set(fields) - {*FIXED, "schedule", "chunks", "recompute", "fsdp"})
    if missing or unknown:
        raise ValueError(
            f"--fix {text!r}: missing {missing or 'none'}, unknown {unknown or 'none'}; name "
            f"{', '.join(FIXED)} (and schedule, chunks, recompute=always|never, fsdp=always|never)"
        )
    for key in ("recompute", "fsdp"):
        if fields.get(key, "always") not in ("always", "never"):
            raise ValueError(f"--fix {text!r}: {key}={fields[key]!r}, not always or never")
    whole = {}
    for key in (*FIXED, "chunks"):
        text_value = fields.get(key, "1")
        if not text_value.isdigit() or int(text_value) < 1:
            raise ValueError(f"--fix {key}={text_value!r}: give a whole number, 1 or more")
        whole[key] = int(text_value)
    tp, pp, dp, b = (whole[key] for key in FIXED)
    if global_batch % (dp * b):
        raise ValueError(f"--fix: dp={dp} x micro_batch={b} does not divide --global-batch {global_batch}")
    chunks = whole["chunks"]
    schedule = fields.get("schedule", "interleaved" if chunks > 1 else "1f1b")
    again = fields.get("recompute", recompute if recompute != "search" else "always") == "always"
    sharded = fields.get("fsdp", fsdp if fsdp != "search" else "never") == "always"
    return Layout(tp, pp, dp, b, global_batch // (dp * b), schedule, chunks, recompute=again, fsdp=sharded)


def _count(parameters: float) -> str:
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


def _line(row: Price) -> str:
    memory = readable_bytes(row.peak_bytes)
    memory += f" (refused: {row.refused})" if row.refused else ""
    memory += f"  partition {list(row.partition)}" if row.partition else ""  # PipelineEngine's partition=
    step = f"{row.step_s:8.3f} s " if row.step_s >= 1 else f"{row.step_s * 1e3:8.3f} ms"
    return (
        f"  {row.layout.describe():<48} step {step}  {row.tokens_per_s:12,.0f} tokens/s  "
        f"MFU {row.mfu:5.1%}  peak {memory}"
    )


def _record(row: Price) -> dict[str, object]:
    layout = row.layout
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "fsdp": layout.fsdp,
        "schedule": layout.schedule,
        "chunks": layout.chunks,
        "micro_batch": layout.micro_batch,
        "num_microbatches": layout.num_microbatches,
        "recompute": "always" if layout.recompute else "never",
        "step_time_s": row.step_s,
        "tokens_per_s": row.tokens_per_s,
        "mfu": row.mfu,
        "peak_bytes": row.peak_bytes,
        "refused": row.refused,
        "partition": list(row.partition) or None,
    }


def _plot(rows: list[Price], path: Path) -> None:
    """Each row's step, split by cause: one horizontal bar a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    causes = [cause for cause in rows[0].parts if cause != "tensor-parallel all-reduces"]  # inside the pipeline's
    figure, axes = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    for index, row in enumerate(rows):
        left = 0.0
        for number, cause in enumerate(causes):
            axes.barh(index, row.parts[cause], left=left, color=f"C{number}", label=cause if index == 0 else None)
            left += row.parts[cause]
    axes.set_yticks(range(len(rows)), [row.layout.describe() for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("seconds a step (predicted)")
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
