"""Fine-tune a Hugging Face causal LM with pipeline parallelism, and write it back as an HF checkpoint.

    python examples/finetune_hf.py                              # a tiny Llama from a config, 2 CPU ranks
    python examples/finetune_hf.py --model path/to/model        # a local model (and its tokenizer), no download
    python examples/finetune_hf.py --schedule zb-v --steps 60

The text is train_gpt.py's: the Python standard library's own source, one paragraph a row, padded
on the right (labels -100 there). The model goes through pipeengine.hf.sequential (its own
parameters, cut into stages), the loss is HF's (next-token cross entropy, token mean over the
whole batch: hf.causal_lm_loss with loss_count=hf.count_labels), and at the end
hf.save_pretrained writes out/finetuned, which AutoModelForCausalLM.from_pretrained loads.
Without --model the tiny Llama reads characters (printable ASCII, train_gpt's vocabulary).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from train_gpt import VOCAB, corpus, documents

from pipeengine import PipelineEngine, hf, launch

RANKS, SCHEDULE, STEPS, BATCH, CONTEXT, MICROBATCHES = 2, "1f1b", 40, 16, 64, 4
LEARNING_RATE, OUT = 3e-3, "out/finetuned"


def load(path: str | None) -> tuple[torch.nn.Module, object]:
    """The model (and its tokenizer: None for the tiny Llama, which reads characters), the same on every rank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path)
        try:
            return model, AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):  # no tokenizer beside it (e.g. this example's own tiny model): characters
            return model, None
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config), None


def main(args: argparse.Namespace) -> None:
    talk = dist.get_rank() == 0
    say = print if talk else (lambda *_, **__: None)
    say("reading the corpus and building the model...", flush=True)
    data = corpus(torch.device("cpu"))
    docs = documents(data)
    model, tokenizer = load(args.model)
    text = "".join(VOCAB[i] for i in data[: 2**20].tolist()) if tokenizer is not None else ""
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    batches = torch.Generator().manual_seed(1)

    def encode(start: int, end: int) -> list[int]:
        if tokenizer is None:
            return data[start : min(end, start + args.context)].tolist()
        return tokenizer(text[start:end])["input_ids"][: args.context]  # type: ignore[index, operator]

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        """One paragraph a row, cut to the context and padded on the right: the padding's labels are -100."""
        ids = torch.full((args.batch, args.context), pad, dtype=torch.int64)
        labels = torch.full((args.batch, args.context), hf.IGNORE, dtype=torch.int64)
        for row, index in enumerate(torch.randint(0, len(docs), (args.batch,), generator=batches).tolist()):
            tokens = torch.tensor(encode(*docs[index]))
            ids[row, : len(tokens)] = tokens
            labels[row, : len(tokens)] = tokens
        return ids, labels

    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=args.microbatches,
                            schedule=args.schedule, loss_count=hf.count_labels)  # fmt: skip
    say(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{engine.schedule.num_ranks} ranks, {args.schedule}", flush=True)  # fmt: skip
    optimizer = torch.optim.AdamW(engine.parameters(), lr=args.learning_rate)
    started = time.perf_counter()
    for step in range(args.steps):
        ids, labels = batch()
        loss = engine.train_step(ids if engine.first else None, labels if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {loss:.3f}  ({time.perf_counter() - started:.0f} s)", flush=True)
    say(f"writing the trained model to {args.out} (an HF checkpoint)...", flush=True)
    written = hf.save_pretrained(engine, model, args.out)
    if written is not None and tokenizer is not None:
        tokenizer.save_pretrained(written)  # type: ignore[attr-defined]
    say(f"wrote {args.out}: AutoModelForCausalLM.from_pretrained({args.out!r}) loads it", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local HF causal LM (a folder with its config and weights)")
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--schedule", default=SCHEDULE)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--out", default=OUT)
    arguments = parser.parse_args()
    launch(main, arguments.ranks, args=(arguments,))

