"""Fine-tune a Hugging Face causal LM with pipeline parallelism, and write it back as an HF checkpoint.

    python examples/finetune_hf.py                              # a tiny Llama from a config, 2 CPU ranks
    python examples/finetune_hf.py --model path/to/model        # a local model (and its tokenizer), no download
    python examples/finetune_hf.py --schedule zb-v --steps 60
    python examples/finetune_hf.py --packed                     # several paragraphs a row, positions restarting

The text is train_gpt.py's: the Python standard library's own source, one paragraph a row, padded
on the right (labels -100 there); with --packed, paragraphs packed into full rows as transformers'
DataCollatorWithFlattening packs them (position ids restarting at each, its first label -100), each
attending to itself alone (hf.sequential(model, packed=True)). The model goes through pipeengine.hf.sequential (its own
parameters, cut into stages), the loss is HF's (next-token cross entropy, token mean over the
whole batch: hf.causal_lm_loss with loss_count=hf.count_labels), and at the end
hf.save_pretrained writes out/finetuned, which AutoModelForCausalLM.from_pretrained loads.
Without --model the tiny Llama reads characters (printable ASCII, train_gpt's vocabulary), and a
character-level tokenizer for them, built here (no download), is saved beside it: then

    model = AutoModelForCausalLM.from_pretrained("out/finetuned")
    tokenizer = AutoTokenizer.from_pretrained("out/finetuned")
    ids = model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=40, do_sample=False)
    print(tokenizer.decode(ids[0]))

which the example does at its end (--prompt).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from generate_hf import generate
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
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )  # characters: no begin or end token (pad: the tokenizer's)
    return LlamaForCausalLM(config), None


def characters() -> object:
    """A tokenizer of train_gpt's characters (one token each, in VOCAB's order: the ids the corpus is read in), built
    with the tokenizers library, offline; what it cannot read is a space, as train_gpt reads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(VOCAB)}, unk_token=" "))
    tokenizer.normalizer = normalizers.Replace(Regex(r"[^\x20-\x7e\n]"), " ")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character its own
    tokenizer.decoder = decoders.Fuse()  # joined as they are, no spaces between
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=" ", pad_token="\n")


def packed_rows(
    rows: int, context: int, docs: list[tuple[int, int]], encode: object, pad: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rows filled with whole paragraphs (the last one cut at the row's end), positions restarting at each, its first
    label -100 (no paragraph predicts the next); ((ids, position_ids), labels)."""
    ids = torch.full((rows, context), pad, dtype=torch.int64)
    positions = torch.zeros((rows, context), dtype=torch.int64)
    for row in range(rows):
        filled = 0
        while filled < context:
            start, end = docs[int(torch.randint(0, len(docs), (1,), generator=generator))]
            tokens = torch.tensor(encode(start, end))[: context - filled]  # type: ignore[operator]
            ids[row, filled : filled + len(tokens)] = tokens
            positions[row, filled : filled + len(tokens)] = torch.arange(len(tokens))
            filled += len(tokens)
    return (ids, positions), ids.masked_fill(positions == 0, hf.IGNORE)


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

    def batch() -> tuple[object, torch.Tensor]:
        """One paragraph a row, cut to the context and padded on the right: the padding's labels are -100."""
        if args.packed:
            return packed_rows(args.batch, args.context, docs, encode, pad, batches)
        ids = torch.full((args.batch, args.context), pad, dtype=torch.int64)
        labels = torch.full((args.batch, args.context), hf.IGNORE, dtype=torch.int64)
        for row, index in enumerate(torch.randint(0, len(docs), (args.batch,), generator=batches).tolist()):
            tokens = torch.tensor(encode(*docs[index]))
            ids[row, : len(tokens)] = tokens
            labels[row, : len(tokens)] = tokens
        return ids, labels

    engine = PipelineEngine(
        hf.sequential(model, packed=args.packed),
        hf.causal_lm_loss,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        loss_count=hf.count_labels,
    )
    say(
        f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{engine.schedule.num_ranks} ranks, {args.schedule}{', packed rows' if args.packed else ''}",
        flush=True,
    )
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
    if written is not None:  # the model's own tokenizer, or the characters' (the tiny Llama)
        (tokenizer if tokenizer is not None else characters()).save_pretrained(written)  # type: ignore[attr-defined]
    say(f"wrote {args.out}: AutoModelForCausalLM.from_pretrained({args.out!r}) loads it, and its tokenizer", flush=True)
    if written is not None and args.prompt:
        say(f"generated: {generate(args.out, args.prompt, args.generate)!r}", flush=True)


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default."""
    made = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = made.add_argument
    add("--model", help="a local HF causal LM (a folder with its config and weights); default: a tiny Llama made here")
    add("--ranks", type=int, default=RANKS, help="processes on this machine")
    add("--schedule", default=SCHEDULE, help="the pipeline schedule")
    add("--steps", type=int, default=STEPS, help="optimizer steps")
    add("--batch", type=int, default=BATCH, help="rows a step")
    add("--context", type=int, default=CONTEXT, help="tokens a row")
    add("--microbatches", type=int, default=MICROBATCHES, help="micro-batches a step")
    add("--learning-rate", type=float, default=LEARNING_RATE, help="AdamW's learning rate")
    add("--out", default=OUT, help="folder the fine-tuned model is written to (save_pretrained)")
    add("--packed", action="store_true", help="several paragraphs a row, positions restarting at each")
    add("--prompt", default="def ", help="generate from it with the written model ('' for none)")
    add("--generate", type=int, default=40, help="tokens to generate")
    return made


if __name__ == "__main__":
    arguments = parser().parse_args()
    launch(main, arguments.ranks, args=(arguments,))
