"""Hugging Face GPT-2 on nbtrain's GPT: "gpt2".

    RuntimeConfig(hf_path="path/to/gpt2", backend_cfg=NBConfig(model_name="gpt2"))

GPT-2 is nbtrain's GPT with a bias on the fused q, k, v projection, the tanh GELU
("gelu_new") and a tied head; `make_config` reads it from config.json (or from
model_config in GPT-2's own field names: n_embd, n_head, n_layer, n_positions,
vocab_size, ...). Dropout is 0 (the runtime's steps are deterministic).

Checkpoint mapping: GPT-2's Conv1D layers store (in, out) weights where nn.Linear has
(out, in), so those four are read transposed:

    transformer.wte / wpe               -> tok / pos
    transformer.h.N.ln_1, ln_2          -> layers.N.ln1, ln2
    transformer.h.N.attn.c_attn (T)     -> layers.N.attn.qkv   (q, k, v split by heads under tp)
    transformer.h.N.attn.c_proj (T)     -> layers.N.attn.proj  (rows under tp)
    transformer.h.N.mlp.c_fc (T)        -> layers.N.mlp.0      (columns under tp)
    transformer.h.N.mlp.c_proj (T)      -> layers.N.mlp.2      (rows under tp)
    transformer.ln_f                    -> ln_f
    lm_head (or wte when tied)          -> head

`hf_config` writes GPT-2's config back (`Runtime.save_pretrained`).
"""

from __future__ import annotations

import re

from . import builtin_gpt
from .gpt import GPTConfig
from .hf_load import HFWeight, read_hf_config
from .hf_load import load_hf_weights as _load

build_model = builtin_gpt.build_model
make_forward_step = builtin_gpt.make_forward_step
tp_plan = builtin_gpt.tp_plan
pp_stages = builtin_gpt.pp_stages

_GELU = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def make_config(model_config: dict, hf_config: dict | None = None) -> GPTConfig:
    """The GPTConfig of a GPT-2 config.json (`hf_config`), overridden by `model_config`
    (GPT-2 field names). Raises ValueError naming what nbtrain's GPT cannot compute."""
    c = {**(hf_config or {}), **model_config}
    if c.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"model 'gpt2' loads model_type 'gpt2', not {c['model_type']!r}")
    hidden = c.get("n_embd", 768)
    inner = c.get("n_inner") or 4 * hidden
    if inner % hidden:
        raise ValueError(
            f"n_inner={inner} is not a multiple of n_embd={hidden}: nbtrain's GPT "
            "needs an integer MLP ratio"
        )
    act = c.get("activation_function", "gelu_new")
    if act not in _GELU:
        raise ValueError(f"activation_function={act!r}: nbtrain's GPT computes {sorted(_GELU)}")
    for flag, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
    ):
        if c.get(flag, ok) != ok:
            raise ValueError(f"{flag}={c[flag]!r}: nbtrain's GPT supports only {flag}={ok}")
    return GPTConfig(
        vocab_size=c.get("vocab_size", 50257),
        seq_len=c.get("n_positions", 1024),
        hidden=hidden,
        heads=c.get("n_head", 12),
        layers=c.get("n_layer", 12),
        mlp_ratio=inner // hidden,
        dropout=0.0,
        tie_embeddings=c.get("tie_word_embeddings", True),
        qkv_bias=True,
        activation=_GELU[act],
        ln_eps=c.get("layer_norm_epsilon", 1e-5),
    )


def hf_config(config: GPTConfig) -> dict:
    """GPT-2's config.json fields for `config` (what `make_config` reads back)."""
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[config.activation]
    if not config.qkv_bias:
        raise ValueError("qkv_bias=False: GPT-2's c_attn has a bias; build with qkv_bias=True")
    drop = config.dropout
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.hidden,
        "n_head": config.heads,
        "n_layer": config.layers,
        "n_inner": config.mlp_ratio * config.hidden,
        "activation_function": act,
        "layer_norm_epsilon": config.ln_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "resid_pdrop": drop,
        "embd_pdrop": drop,
        "attn_pdrop": drop,
    }


_LAYER = {
    "ln1": ("ln_1", False),
    "ln2": ("ln_2", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "mlp.0": ("mlp.c_fc", True),
    "mlp.2": ("mlp.c_proj", True),
}


def hf_names(config=None):
    """nbtrain GPT parameter name -> where GPT-2's files keep it."""

    def names(plain: str) -> list[HFWeight]:
        top = {
            "tok.weight": ["transformer.wte.weight"],
            "pos.weight": ["transformer.wpe.weight"],
            "head.weight": ["lm_head.weight", "transformer.wte.weight"],
        }
        if plain in top:
            return [HFWeight(n) for n in top[plain]]
        if plain.startswith("ln_f."):
            return [HFWeight("transformer." + plain)]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", plain)
        if m and m.group(2) in _LAYER:
            module, conv = _LAYER[m.group(2)]
            kind = m.group(3)
            return [
                HFWeight(
                    f"transformer.h.{m.group(1)}.{module}.{kind}",
                    transpose=conv and kind == "weight",
                )
            ]
        return []

    return names


def load_hf_weights(model, hf_path: str) -> int:
    read_hf_config(hf_path)  # a clear error for a folder that is not a model's
    return _load(model, hf_path, hf_names())
