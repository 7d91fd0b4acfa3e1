"""Llama-family folders (Llama, Qwen2) on nbtrain's Llama (models/llama.py): "llama".

    RuntimeConfig(hf_path="path/to/qwen2",
                  backend_cfg=NBConfig(model_name="llama", parallel=ParallelConfig(tp_size=2)))

`make_config` reads config.json (model_config holds overrides in Hugging Face's field
names; without a folder, model_config is the whole config, e.g. {"vocab_size": 64,
"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
"num_attention_heads": 4, "num_key_value_heads": 2}).

`hf_config` writes the config back (`Runtime.save_pretrained`).

Checkpoint mapping: nbtrain's Llama has Hugging Face's parameter names, so each name
maps to itself; a tied head (tie_word_embeddings, no lm_head.weight in the files)
reads the embedding. Under tensor parallelism (`hf_tp.llama_plan`) q, k, v and the
MLP's gate and up projections split by output rows (heads), o and down by input
columns, the embedding and head by vocabulary; norms stay whole.
"""

from __future__ import annotations

import dataclasses

from .builtin_gpt import make_forward_step  # noqa: F401 (the protocol's; model(ids, pos))
from .hf_load import HFWeight, read_hf_config
from .hf_load import load_hf_weights as _load
from .hf_tp import llama_plan
from .llama import Llama, LlamaConfig, llama_layers


def make_config(model_config: dict, hf_config: dict | None = None) -> LlamaConfig:
    """The LlamaConfig of a config.json (`hf_config`) overridden by `model_config`."""
    merged = {**(hf_config or {"model_type": "llama"}), **model_config}
    return LlamaConfig.from_hf(merged)


def hf_names(config=None):
    """Each parameter under its own name; the head falls back on the embedding (tied)."""

    def names(plain: str) -> list[HFWeight]:
        if plain == "lm_head.weight":
            return [HFWeight(plain), HFWeight("model.embed_tokens.weight")]
        return [HFWeight(plain)]

    return names


def hf_config(config: LlamaConfig) -> dict:
    """config.json's fields for `config` (what `make_config` reads back)."""
    fields = dataclasses.asdict(config)
    del fields["qkv_bias"]  # Qwen2 has q, k, v biases by its model type
    if config.qkv_bias != (config.model_type == "qwen2"):
        raise ValueError(
            f"qkv_bias={config.qkv_bias} with model_type {config.model_type!r}: a Hugging "
            "Face folder has q, k, v biases exactly when its model type is 'qwen2'"
        )
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[config.model_type]
    return {**fields, "hidden_act": "silu", "architectures": [arch]}


def build_model(config: LlamaConfig, parallel=None) -> Llama:
    return Llama(config)


def load_hf_weights(model, hf_path: str) -> int:
    read_hf_config(hf_path)
    return _load(model, hf_path, hf_names())


def tp_plan(config: LlamaConfig) -> dict:
    return llama_plan(config)


def pp_stages(model: Llama, pipe_size: int, positions=None) -> list:
    layers = llama_layers(model, positions)
    if pipe_size > len(layers):
        raise ValueError(
            f"pipe_size {pipe_size} is more than the model's {len(layers)} "
            "layers (embedding, decoder layers, head): use fewer stages"
        )
    return layers
