"""What a split backward costs beside a whole one: F, B and I + W of one stage and one micro-batch, per model.

    python benchmarks/split_backward.py                      # the three stages, 15 alternating rounds each
    python benchmarks/split_backward.py --rounds 5 --models mlp
    python benchmarks/split_backward.py --width 16            # the fixed costs alone: every stage 16 wide
    python benchmarks/split_backward.py --device cuda --width 2048 --batch 64   # on a GPU, launch-bound and not

Issue 61's first step: zero-bubble schedules pay only if I + W (pipeengine.step.backward: I to the stage's input,
and an element-wise node's weights, now; W for the weight GEMMs later, from the gradient I kept at each node with
weights beneath it) costs what B (one autograd call for both) does. Three stages, each as a rank of a 2-stage
pipeline holds it, on one thread (a rank's share of a 2-core machine): the benchmark MLP's (4 x Linear(1024), a
micro-batch of 8 rows: docs/benchmarks.md's schedule table), the GPT example's (2 blocks of examples/train_gpt.py,
width 256, 4 heads, 4 x 64 tokens) and a Hugging Face Llama's (2 LlamaDecoderLayer, hidden 256, 4 heads, 4 x 64
tokens; skipped without transformers).

Memory as a launched CPU rank keeps it (pipeengine.launcher.launch.keep_freed_memory: freed blocks reused, not
returned): without it a weight's fresh gradient pays page faults that dwarf its matmul. Each round times, one after
the other on the same input and output gradient: F; B (torch.autograd.backward to the input and the weights); I then
W as the engine runs them; and, to say where a difference goes, W as one autograd call from the stage's output (what
W falls back to: it repeats the input side) and a bare I (autograd.grad to the input, no graph kept, no hooks). B
and I + W run twice in a round: a step's first micro-batch (the weights' .grad made) and a later one (added into the
.grad held; columns "later"); then a step's --microbatches (8) of each from no .grad, their times summed (columns "a
step"). Medians over the rounds; the methods alternate within a round, so a slow moment of the machine falls on all
of them. Writes out/bench/split_backward.{json,txt}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import OUT, write_report
from torch import nn

from pipeengine.launcher.launch import keep_freed_memory
from pipeengine.step.backward import WeightPass, backward_input

MODELS = ("mlp", "gpt", "llama")


def stage(name: str, width: int | None = None, batch: int | None = None) -> tuple[nn.Module, torch.Tensor]:
    """A stage of the named model and one micro-batch's input (``width``, ``batch``: the rows or sequences of the
    micro-batch, in place of the model's own)."""
    torch.manual_seed(0)
    if name == "mlp":
        width = width or 1024
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]), torch.randn(batch or 8, width)
    width = width or 256
    if name == "gpt":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        from train_gpt import Block

        return nn.Sequential(Block(width, 4), Block(width, 4)), torch.randn(batch or 4, 64, width)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 688 // 256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=256,
    )
    rotary = LlamaRotaryEmbedding(config)

    class Layers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, index) for index in range(2))
            self.rotary = rotary

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            positions = self.rotary(x, torch.arange(x.shape[1], device=x.device)[None])
            for layer in self.layers:
                out = layer(x, position_embeddings=positions, attention_mask=None)
                x = out[0] if isinstance(out, tuple) else out
            return x

    return Layers(), torch.randn(batch or 4, 64, width)


def timings(
    name: str,
    rounds: int,
    width: int | None = None,
    batch: int | None = None,
    device: str = "cpu",
    microbatches: int = 8,
) -> dict[str, float]:
    """Median seconds of each way of running the stage's backward, and its forward (on a GPU, each timed region
    begins and ends with the device's work synchronized, so it counts the kernels and not only their launch)."""
    module, example = stage(name, width, batch)
    module.to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    x = example.to(device).requires_grad_()
    on_gpu = torch.device(device).type == "cuda"

    def clock() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    grad = torch.randn_like(module(x))

    def forward() -> torch.Tensor:
        return module(x)  # type: ignore[no-any-return]

    def whole() -> float:
        y = forward()
        start = clock()
        torch.autograd.backward(y, grad, inputs=[x, *params])
        return clock() - start

    def split() -> tuple[float, float]:
        y = forward()
        start = clock()
        _, weights = backward_input((y,), (grad,), (x,), params)
        middle = clock()
        weights.run()
        return middle - start, clock() - middle

    def one_call() -> float:
        y = forward()
        torch.autograd.grad(y, [x], grad, retain_graph=True)
        start = clock()
        WeightPass(fallback=((y,), (grad,), params)).run()
        return clock() - start

    def bare() -> float:
        y = forward()
        start = clock()
        torch.autograd.grad(y, [x], grad)
        return clock() - start

    def timed(step: Callable[[], object]) -> float:
        start = clock()
        step()
        return clock() - start

    def step(backward: Callable[[], float | tuple[float, float]]) -> float:
        """A step's backwards on this stage: ``microbatches`` of them from no .grad, their times summed."""
        module.zero_grad(set_to_none=True)
        return sum(sum(t) if isinstance(t, tuple) else t for t in (backward() for _ in range(microbatches)))

    keys = ("F", "B", "I", "W", "B later", "I later", "W later", "W one call", "I bare", "B step", "I + W step")
    found: dict[str, list[float]] = {key: [] for key in keys}
    for round_ in range(rounds + 2):  # two to warm up
        module.zero_grad(set_to_none=True)
        f = timed(forward)
        b = whole()  # a step's first micro-batch: the weights' .grad made
        b_later = whole()  # a later one: added into the .grad held
        module.zero_grad(set_to_none=True)
        i, w = split()
        i_later, w_later = split()
        module.zero_grad(set_to_none=True)
        w_once = one_call()
        i_bare = bare()
        b_step, split_step = step(whole), step(split)
        if round_ >= 2:
            values = (f, b, i, w, b_later, i_later, w_later, w_once, i_bare, b_step, split_step)
            for key, value in zip(found, values, strict=True):
                found[key].append(value)
    medians = {key: statistics.median(values) for key, values in found.items()}
    medians["roots"], medians["calls"] = (float(n) for n in _roots(module, x, grad, params))
    return medians


def _roots(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, params: list[nn.Parameter]) -> tuple[int, int]:
    """The nodes with weights beneath them that the engine's W restarts at, and how many autograd calls it makes
    (the others are a formula of what the node saved: pipeengine.step.backward._direct_weights)."""
    _, weights = backward_input((module(x),), (grad,), (x,), params)
    roots = len(weights.roots)
    return roots, weights.run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, help="every stage this wide (a multiple of 4), in place of its own")
    parser.add_argument("--batch", type=int, help="a micro-batch's rows (MLP) or sequences of 64 tokens (GPT, Llama)")
    parser.add_argument("--device", default="cpu", help="cpu (the default: a rank's share of this machine) or cuda")
    parser.add_argument("--microbatches", type=int, default=8, help="a step's micro-batches (the step columns)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a launched CPU rank does (else a weight's fresh gradient pays page faults each time)
    rows, lines = [], []
    lines.append(
        "| stage | F ms | B ms | I ms | W ms | I + W over B | later: B ms | I + W ms | over B "
        f"| a step of {args.microbatches}: B ms | I + W ms | over B | W roots | W's autograd calls "
        "| W as one call ms | bare I ms |"
    )
    lines.append("|-|-|-|-|-|-|-|-|-|-|-|-|-|-|-|-|")
    for name in args.models:
        try:
            t = timings(name, args.rounds, args.width, args.batch, args.device, args.microbatches)
        except ImportError as missing:
            print(f"{name}: skipped ({missing})")
            continue
        ms = {key: 1e3 * value for key, value in t.items() if key not in ("roots", "calls")}
        ratio = (t["I"] + t["W"]) / t["B"]
        later = (t["I later"] + t["W later"]) / t["B later"]
        whole_step = t["I + W step"] / t["B step"]
        rows.append(
            {
                "stage": name,
                **{k: round(v, 3) for k, v in ms.items()},
                "split_over_whole": round(ratio, 3),
                "split_over_whole_later": round(later, 3),
                "split_over_whole_step": round(whole_step, 3),
                "microbatches": args.microbatches,
                "w_roots": int(t["roots"]),
                "w_calls": int(t["calls"]),
                "rounds": args.rounds,
                "threads": args.threads,
                "width": args.width,
                "batch": args.batch,
                "device": args.device,
            }
        )
        lines.append(
            f"| {name} | {ms['F']:.2f} | {ms['B']:.2f} | {ms['I']:.2f} | {ms['W']:.2f} | {ratio:.2f}x | "
            f"{ms['B later']:.2f} | {ms['I later'] + ms['W later']:.2f} | {later:.2f}x | "
            f"{ms['B step']:.1f} | {ms['I + W step']:.1f} | {whole_step:.3f}x | "
            f"{int(t['roots'])} | {int(t['calls'])} | {ms['W one call']:.2f} | "
            f"{ms['I bare']:.2f} |"
        )
        print(lines[-1], flush=True)
    write_report("split_backward", rows, lines)
    print(f"wrote {OUT}/split_backward.*")


if __name__ == "__main__":
    main()
