"""A Llama-family causal LM (Llama, Qwen2) in plain PyTorch, under Hugging Face's
parameter names, so a `LlamaForCausalLM` / `Qwen2ForCausalLM` state_dict loads into it
(strict) and `llama_plan(cfg)` from `hf_tp` tensor-parallelises it:

    cfg = LlamaConfig.from_hf(json.load(open("config.json")))
    model = Llama(cfg)
    model.load_state_dict(hf_state_dict)            # same names, same tensors
    nbtrain.parallelize(model, llama_plan(cfg))     # or: stage_of(llama_layers(model))

RMSNorm, rotary position embeddings (Hugging Face's rotate_half layout), grouped-query
attention and a SwiGLU MLP. The model holds no buffers: the rotary frequencies are
computed in each forward from the config on the activations' device, so
`with torch.device("meta"): Llama(cfg)` builds it without memory and
`to_empty(device=...)` plus a state_dict (or an initialiser) materialises it.

The attention reshapes with -1 heads and takes the key/value group size from the
projections' outputs, not from the config, so it runs unchanged on the fewer local
heads a tensor-parallel (column-split) q/k/v projection produces.

Packed documents, as in `nbtrain.models.gpt`: `model(ids, position_ids)` with
position_ids (rows, seq) restarting at 0 where each document starts rotates each
document's tokens from position 0 and masks attention causally within each document;
without position_ids a row is one causal sequence (the `is_causal` fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import check_position_ids, document_causal_mask
from .gpt_pipe import StagePositions

MODEL_TYPES = ("llama", "qwen2")


@dataclass
class LlamaConfig:
    """Shapes and flags of a Llama-family model, under Hugging Face's field names."""

    vocab_size: int
    hidden_size: int  # model width
    intermediate_size: int  # MLP width (gate/up output features)
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int | None = None  # key/value heads (grouped-query); None: = heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # rotary base
    max_position_embeddings: int = 2048  # informational: rotary needs no table
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    attention_bias: bool = False  # Llama's flag: bias on q, k, v and o projections
    qkv_bias: bool = False  # Qwen2's layout: bias on q, k, v only
    initializer_range: float = 0.02  # std of the normal init of linear/embedding weights
    model_type: str = "llama"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig: {name} = {value!r}; it must be a positive int")
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = heads
        if self.num_key_value_heads <= 0 or heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_key_value_heads = {self.num_key_value_heads} "
                f"must be positive and divide num_attention_heads = {heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise ValueError(
                    f"LlamaConfig: hidden_size = {self.hidden_size} is not a "
                    f"multiple of num_attention_heads = {heads}: set head_dim"
                )
            self.head_dim = self.hidden_size // heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim = {self.head_dim}; rotary embeddings "
                "need a positive even head_dim"
            )
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig: model_type = {self.model_type!r}; use one of {MODEL_TYPES}"
            )

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """The config of a Hugging Face `config.json` dict (or `PretrainedConfig.to_dict()`)
        of model_type "llama" or "qwen2". Raises ValueError, naming the value, for any
        other model type and for features this model does not compute: rope scaling,
        partial rotary, sliding-window attention, an MLP bias, an activation but SiLU."""
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig.from_hf: model_type {model_type!r} is not supported; "
                f"use one of {MODEL_TYPES}"
            )
        if model_type == "qwen2":
            if d.get("use_sliding_window"):
                raise ValueError(
                    "LlamaConfig.from_hf: use_sliding_window = True (Qwen2 "
                    "sliding-window attention) is not supported; set it False"
                )
            kinds = set(d.get("layer_types") or ["full_attention"])
            if kinds != {"full_attention"}:
                raise ValueError(
                    f"LlamaConfig.from_hf: layer_types {sorted(kinds)}; only "
                    "'full_attention' layers are supported"
                )
        if d.get("mlp_bias"):
            raise ValueError("LlamaConfig.from_hf: mlp_bias = True is not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"LlamaConfig.from_hf: hidden_act {act!r}; only 'silu' is supported")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            qkv_bias=model_type == "qwen2",
            initializer_range=d.get("initializer_range", 0.02),
            model_type=model_type,
        )


def _rope_theta(d: dict) -> float:
    """The rotary base of an HF config dict: transformers 5 keeps it (and the rope type)
    in `rope_parameters`; older config.json files have top-level `rope_theta` and
    `rope_scaling` (None for plain rotary)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = d.get(key) or {}
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                f"LlamaConfig.from_hf: {key} = {params!r}; only one plain "
                "rotary setting for all layers is supported"
            )
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"LlamaConfig.from_hf: {key} has rope_type {kind!r}; rope "
                "scaling is not supported, only 'default' rotary embeddings"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"LlamaConfig.from_hf: partial_rotary_factor = "
                f"{params['partial_rotary_factor']} is not supported"
            )
    params = d.get("rope_parameters") or {}
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32 and cast back
    to x's dtype before the weight is applied (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_cos_sin(position_ids, head_dim: int, theta: float, dtype):
    """cos and sin (rows, seq, head_dim) in `dtype` for int position_ids (rows, seq),
    computed in float32 on position_ids' device; each half of head_dim repeats the
    head_dim/2 frequencies theta^(-2i/head_dim) (the rotate_half layout). Local."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device)
    inv_freq = 1.0 / (theta ** (exponent.float() / head_dim))
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """x (rows, heads, seq, head_dim) rotated by cos, sin (rows, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings: hidden (rows, seq, width)
    -> (rows, seq, width)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        q_width, kv_width = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=qkv_bias)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, position_ids=None, cp=None, doc_ids=None):
        """Under `cp` (a ContextParallel, the runtime's pipeline layers pass it) x is
        this rank's sequence shard, position_ids its tokens' positions within their
        documents (rotary) and doc_ids their documents: attention runs around the ring."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # The rows of q (not x): a sequence-parallel column split gathers them.
        rows, t = q.shape[:2]
        q, k, v = (z.view(rows, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        groups, rest = divmod(q.shape[1], k.shape[1])
        if rest:
            raise ValueError(
                f"attention: {q.shape[1]} query heads for {k.shape[1]} key/value "
                "heads; tensor parallelism must split both by the same tp_size"
            )
        if cp is not None:
            return self._ring(q, k, v, groups, position_ids, cp, doc_ids)
        if position_ids is None:
            positions = torch.arange(t, device=q.device).expand(rows, t)
            mask = None
        else:
            positions = position_ids.to(q.device, non_blocking=True)
            if tuple(positions.shape) != (rows, t):
                raise ValueError(
                    f"attention: position_ids of shape {tuple(positions.shape)} "
                    f"for {rows} rows of {t} tokens; pass one id per token"
                )
            mask = document_causal_mask(positions)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=groups > 1
        )
        return self.o_proj(y.transpose(1, 2).reshape(rows, t, -1))

    def _ring(self, q, k, v, groups, position_ids, cp, doc_ids):
        rows, t = q.shape[0], q.shape[2]
        if position_ids is None or doc_ids is None:
            raise ValueError(
                "attention under context parallelism needs the shard's "
                "position_ids and doc_ids (ContextParallel.shard_batch)"
            )
        positions = position_ids.to(q.device, non_blocking=True)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if groups > 1:  # the ring passes whole heads: every query head its own K/V
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = cp.attention(q, k, v, doc_ids.to(q.device, non_blocking=True))
        return self.o_proj(y.transpose(1, 2).reshape(rows, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual: (rows, seq, width) ->
    (rows, seq, width); position_ids (rows, seq) for packed documents."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, position_ids=None, cp=None, doc_ids=None):
        h = self.input_layernorm(x)
        x = x + (
            self.self_attn(h, position_ids)
            if cp is None
            else self.self_attn(h, position_ids, cp=cp, doc_ids=doc_ids)
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack (Hugging Face's `model.` prefix): embedding, layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    """Token ids (rows, seq) int, on any device, and optional position_ids (rows, seq)
    (packed documents, see the module docstring) -> logits (rows, seq, vocab_size) in
    the weights' dtype, on their device. Parameter names are LlamaForCausalLM's."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.initializer_range)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """With tie_word_embeddings, make lm_head's weight embed_tokens' (one Parameter).
        Local."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        # Module._apply replaces each module's parameters one by one (to_empty always),
        # which would leave lm_head and embed_tokens two separate tensors: restore a tie
        # that held before (and only that: tensor parallelism replaces both modules).
        tied = _weight(self.lm_head) is not None and _weight(self.lm_head) is _weight(
            self.model.embed_tokens
        )
        super()._apply(fn, recurse)
        if tied and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def forward(self, input_ids, position_ids=None):
        if input_ids.dtype.is_floating_point or input_ids.dim() != 2:
            raise TypeError(
                f"Llama takes token ids of shape (batch, seq) and an integer "
                f"dtype; got {input_ids.dtype} of shape {tuple(input_ids.shape)}"
            )
        check_position_ids(position_ids, input_ids)
        # Token ids from anywhere (a CPU data loader) meet the weights on their device.
        input_ids = input_ids.to(self.model.embed_tokens.weight.device, non_blocking=True)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, position_ids)
        return self.lm_head(self.model.norm(x))


def _weight(module: nn.Module):
    return module._parameters.get("weight")


class Embed(nn.Module):
    """The token embedding as a pipeline layer: ids (rows, seq) -> hidden. With
    `positions`, it checks the fed position ids against the ids' shape."""

    def __init__(self, llama: Llama, positions: StagePositions | None = None):
        super().__init__()
        self.embed_tokens = llama.model.embed_tokens
        self.positions = positions

    def forward(self, input_ids):
        if self.positions is not None:
            check_position_ids(self.positions.read(input_ids), input_ids)
        return self.embed_tokens(input_ids.to(self.embed_tokens.weight.device, non_blocking=True))


class FedDecoderLayer(DecoderLayer):
    """A decoder layer (its own modules, under the same names) whose attention reads
    the current micro-batch's position ids from a StagePositions."""

    def __init__(self, layer: DecoderLayer, positions: StagePositions):
        nn.Module.__init__(self)
        self.input_layernorm, self.self_attn = layer.input_layernorm, layer.self_attn
        self.post_attention_layernorm, self.mlp = layer.post_attention_layernorm, layer.mlp
        self.positions = positions

    def forward(self, x, position_ids=None):
        if position_ids is None:
            position_ids = self.positions.read(x)
        cp, docs = self.positions.cp, self.positions.current_docs
        if cp is not None:  # a sequence shard: ring attention within the documents
            return super().forward(x, position_ids, cp=cp, doc_ids=docs)
        return super().forward(x, position_ids)


class Head(nn.Module):
    """Final norm and lm_head: hidden -> logits (rows, seq, vocab_size)."""

    def __init__(self, llama: Llama):
        super().__init__()
        self.norm, self.lm_head = llama.model.norm, llama.lm_head

    def forward(self, x):
        return self.lm_head(self.norm(x))


def llama_layers(llama: Llama, positions: StagePositions | None = None) -> list[nn.Module]:
    """The model as consecutive pipeline layers, sharing its modules (and a tied
    weight, as one Parameter): [embedding, decoder layer 0..L-1, head]. With
    `positions`, the layers read packed documents' position ids from it (see
    `nbtrain.models.gpt_pipe.StagePositions`); without, every row is one causal
    sequence. Local."""
    layers = llama.model.layers
    if positions is not None:
        layers = [FedDecoderLayer(layer, positions) for layer in layers]
    return [Embed(llama, positions), *layers, Head(llama)]
