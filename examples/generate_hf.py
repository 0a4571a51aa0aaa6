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


def generate(
    directory: str,
    prompt: str,
    tokens: int,
    *,
    sample: bool = False,
    temperature: float = 0.8,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """The prompt and what the model in ``directory`` generates after it, with the tokenizer beside it (greedy,
    unless ``sample``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory).to(device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if sample else {"do_sample": False}
    torch.manual_seed(seed)  # what sample draws
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    # the text without the begin and end tokens; not skip_special_tokens=True: the characters' tokenizer has the
    # space as its unknown token and the newline as its padding, which would go too
    ends = {tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
    return tokenizer.decode([i for i in ids[0].tolist() if i not in ends])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    print(
        generate(
            args.model,
            args.prompt,
            args.max_new_tokens,
            sample=args.sample,
            temperature=args.temperature,
            seed=args.seed,
            device=args.device,
        ),
        flush=True,
    )


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default."""
    made = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
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
