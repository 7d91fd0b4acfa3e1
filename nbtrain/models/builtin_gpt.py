"""nbtrain's GPT (models/gpt.py) as a registered model package: "gpt".

    NBConfig(model_name="gpt", model_config={"preset": "tiny", "vocab_size": 64})

model_config holds GPTConfig fields, with "preset" ("tiny", "small", "medium") picking
a size. The GPT has no Hugging Face format of its own (GPT-2 folders load through
"gpt2", on the same GPT): `hf_names` maps each name to itself, so a folder whose
model.safetensors was written by `nbtrain.save` loads.
"""

from __future__ import annotations

from ..context_parallel import ContextParallel
from .gpt import GPT, GPTConfig
from .gpt_pipe import gpt_layers
from .gpt_tp import gpt_plan
from .hf_load import HFWeight
from .hf_load import load_hf_weights as _load


def make_config(
    model_config: dict, hf_config: dict | None = None, config_class=GPTConfig
) -> GPTConfig:
    """The `config_class` (GPTConfig or a subclass) of `model_config`: its fields, with
    "preset" for a size."""
    if hf_config is not None:
        raise ValueError(
            "nbtrain's GPT has no Hugging Face config: load GPT-2 folders with "
            "model_name='gpt2' (a file written by nbtrain.save loads with "
            "nbtrain.load), or give hf_path=None"
        )
    fields = dict(model_config)
    preset = fields.pop("preset", None)
    return config_class.preset(preset, **fields) if preset else config_class(**fields)


def hf_names(config=None):
    """Each parameter under its own name (files written by `nbtrain.save`)."""
    return lambda name: [HFWeight(name)]


def build_model(config: GPTConfig, parallel=None) -> GPT:
    """The plain GPT (any layout: tensor and pipeline parallelism come after). Its
    forward splits sequences over the topology's cp group only when `parallel` asks
    for context parallelism (cp > 1): a reference built beside it stays whole."""
    model = GPT(config)
    if getattr(parallel, "cp_size", 1) > 1:  # the runtime has made the topology for this layout
        model.context_parallel = ContextParallel.from_topology()
    return model


def load_hf_weights(model, hf_path: str) -> int:
    return _load(model, hf_path, hf_names())


def make_forward_step(model: GPT):
    """(input_ids, position_ids) -> logits."""
    return lambda input_ids, position_ids=None: model(input_ids, position_ids)


def tp_plan(config: GPTConfig) -> dict:
    return gpt_plan(config)


def pp_stages(model: GPT, pipe_size: int, positions=None) -> list:
    if pipe_size > len(model.layers) + 2:
        raise ValueError(
            f"pipe_size {pipe_size} is more than the GPT's {len(model.layers)} "
            "blocks + embedding + head: use fewer stages or more layers"
        )
    return gpt_layers(model, positions)
