"""Generate text with the model examples/finetune_hf.py wrote, and the tokenizer it saved beside it.

    python examples/finetune_hf.py --packed --steps 400                 # writes out/finetuned
    python examples/generate_hf.py                                      # greedy, from "def "
    python examples/generate_hf.py --prompt "class " --max-new-tokens 80
    python examples/generate_hf.py --sample --temperature 0.8 --seed 1  # sampled instead

The folder is a plain Hugging Face checkpoint (hf.save_pretrained wrote it): transformers loads it with no
pipeengine, on one process. It prints the prompt and what follows it, and nothing else, on stdout.
"""

from __future__ import annotations

import argparse

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parser().parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0} if args.sample else {
        "do_sample": False}  # fmt: skip
    torch.manual_seed(args.seed)  # what --sample draws
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             **sampling)  # fmt: skip
    # the text without the begin and end tokens; not skip_special_tokens=True: the characters' tokenizer has the
    # space as its unknown token and the newline as its padding, which would go too
    ends = {tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
    print(tokenizer.decode([i for i in ids[0].tolist() if i not in ends]), flush=True)


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default."""
    made = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add = made.add_argument
    add("--model", default="out/finetuned", help="the folder finetune_hf.py wrote (its --out): model and tokenizer")
    add("--prompt", default="def ", help="the text to go on from")
    add("--max-new-tokens", type=int, default=40, help="tokens to generate (characters, for the tiny Llama)")
    add("--sample", action="store_true", help="sample each token (without it: greedy, the likeliest)")
    add("--temperature", type=float, default=0.8, help="with --sample: below 1 sharper, above 1 flatter")
    add("--seed", type=int, default=0, help="with --sample: the seed of what is drawn")
    add("--device", default=DEVICE, help="where the model runs")
    return made


if __name__ == "__main__":
    main()
