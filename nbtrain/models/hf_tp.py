"""Tensor parallelism for Hugging Face Llama-family causal LMs (Llama, Mistral, Qwen2,
...): the plan `nbtrain.parallelize` takes.

    nbtrain.init_distributed(tp_size=2)
    model = nbtrain.parallelize(AutoModelForCausalLM.from_config(cfg), llama_plan(cfg))

Megatron's layout: q, k and v projections split by heads (key/value heads too, so
grouped-query attention keeps its ratio), the output projection by rows, the MLP's
gate and up projections by columns and its down projection by rows, the vocabulary
of the embedding and the head. The attention reshapes with -1 heads, so it runs on
its local heads unchanged; the logits come back full-width, so `labels=` losses and
generation work as before.
"""

from __future__ import annotations

from ..comm.context import get_context


def llama_plan(config) -> dict:
    """The plan for a model built from `config` (a LlamaConfig or a sibling)."""
    tp = get_context().topology.tp_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, n in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % tp:
            raise ValueError(
                f"{what} = {n}, which tp_size {tp} does not divide: choose a "
                "tp_size that divides the head counts and the MLP width"
            )
    tied = getattr(config, "tie_word_embeddings", False)
    if not tied and config.vocab_size % tp:
        raise ValueError(
            f"vocab_size = {config.vocab_size} with an untied head: tp_size {tp} must divide it"
        )
    layer = "model.layers.*."
    return {
        "model.embed_tokens": "vocab",
        layer + "self_attn.q_proj": "colwise",
        layer + "self_attn.k_proj": "colwise",
        layer + "self_attn.v_proj": "colwise",
        layer + "self_attn.o_proj": "rowwise",
        layer + "mlp.gate_proj": "colwise",
        layer + "mlp.up_proj": "colwise",
        layer + "mlp.down_proj": "rowwise",
        "lm_head": "tied_head" if tied else "head",
    }
