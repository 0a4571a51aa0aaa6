"""Plan a GPU cluster layout for Llama-2-7B's shapes from this machine (nothing allocated, no GPU needed).

    python -m pipeengine.tune --model examples.plan_cluster:llama_7b --devices 64 --hardware a100-80gb \\
        --global-batch 512 --seq 2048
    python examples/plan_cluster.py                 # the same, from Python

``--model`` also takes a Hugging Face config.json; ``--fix tp=2,pp=1,dp=32,micro_batch=1`` prices one layout.
"""

from __future__ import annotations

import sys
from typing import Any


def llama_7b() -> Any:
    """Llama-2-7B's shapes (its config.json's sizes): a config, no weights."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)  # fmt: skip


if __name__ == "__main__":
    from pipeengine.tune import main

    sys.exit(main(["--model", "examples.plan_cluster:llama_7b", "--devices", "64", "--hardware", "a100-80gb",
                   "--global-batch", "512", "--seq", "2048", *sys.argv[1:]]))  # fmt: skip
