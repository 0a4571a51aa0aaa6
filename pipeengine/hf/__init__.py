"""Hugging Face causal language models through the pipeline, in and out (``pip install -e ".[hf]"``).

    from pipeengine import PipelineEngine, hf
    model = AutoModelForCausalLM.from_pretrained(path)              # or from a config, for a new model
    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=8, loss_count=hf.count_labels)
    loss = engine.train_step(input_ids, labels)                     # labels as HF takes them: unshifted, -100 ignored
    loss = engine.train_step((input_ids, attention_mask), labels)   # left padding: the mask crosses every stage
    hf.save_pretrained(engine, model, "out/")                       # every rank calls it; from_pretrained loads it

``sequential(model)`` finds the parts structurally, so one adapter serves the Llama-like families
(``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``) and GPT-2
(``model.transformer.{wte, wpe, drop, h, ln_f}``); it takes only the families it has been checked
to compute exactly (families.py) and refuses the others, naming the config field it does not apply.

    layers.py     the Sequential: Embed, Decoder (masks per layer), Final; the loss and its count
    families.py   the families computed exactly, how each masks its layers, what is refused
    export.py     save_pretrained: the engine's whole state, under the model's names
    parallel.py   tp_plan: the config's own tensor-parallel plan, heads checked against the degree
"""

from pipeengine.hf.export import save_pretrained
from pipeengine.hf.layers import IGNORE, causal_lm_loss, count_labels, sequential
from pipeengine.hf.parallel import tp_plan

__all__ = ["IGNORE", "causal_lm_loss", "count_labels", "save_pretrained", "sequential", "tp_plan"]
