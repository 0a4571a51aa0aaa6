"""Plan a GPU cluster layout for Llama-2-7B's shapes from this machine (nothing allocated, no GPU needed).

    python -m pipeengine.tune --model examples.plan_cluster:llama_7b --devices 64 --hardware a100-80gb \\
        --global-batch 512 --seq 2048
    python examples/plan_cluster.py                 # the same, from Python

    python -m pipeengine.tune --model examples.plan_cluster:gpt_1b --devices 64 --hardware h100-sxm \
        --global-batch 256 --seq 2048   # any nn.Sequential: train_gpt.py's GPT at 1.3B, on the meta device

``--model`` also takes a Hugging Face config.json; ``--fix tp=2,pp=1,dp=32,micro_batch=1`` prices one layout.
"""

from __future__ import annotations

import sys
from typing import Any


def llama_7b() -> Any:
    """Llama-2-7B's shapes (its config.json's sizes): a config, no weights."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )


def gpt_1b() -> tuple[Any, Any, Any]:
    """examples/train_gpt.py's GPT (an nn.Sequential: embedding, blocks, head) at GPT-3 XL's sizes (24 layers, width
    2048, 16 heads; Brown et al. 2020, Table 2.1), built on the meta device: (model, loss_fn, sample), the problem
    the planner on this machine takes too. Nothing is allocated."""
    import torch

    from examples.train_gpt import gpt, summed_loss

    with torch.device("meta"):
        model = gpt(24, 2048, 16, 2048)
        return model, summed_loss, torch.zeros(1, 2048, dtype=torch.long)


if __name__ == "__main__":
    from pipeengine.tune import main

    sys.exit(
        main(
            [
                "--model",
                "examples.plan_cluster:llama_7b",
                "--devices",
                "64",
                "--hardware",
                "a100-80gb",
                "--global-batch",
                "512",
                "--seq",
                "2048",
                *sys.argv[1:],
            ]
        )
    )
