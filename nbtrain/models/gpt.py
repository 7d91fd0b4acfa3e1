"""A small GPT (nanoGPT-shaped) used by the demo, tutorials, tests and benchmarks.

Plain PyTorch: `wrap(GPT(cfg))` shards it, `GPT(cfg)` alone is the single-process
reference every sharded result is compared with.

Packed documents: `model(idx, position_ids)` with position_ids (rows, seq) restarting
at 0 where each document starts (Hugging Face's packing convention) embeds each
document's positions from 0 and masks attention causally within each document, so a
row of packed documents computes what the documents would one by one. Without
position_ids a row is one causal sequence (the `is_causal` fast path).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256      # byte-level tokens by default
    seq_len: int = 64          # longest sequence (positions embedded)
    hidden: int = 64           # model width
    heads: int = 4             # attention heads; hidden % heads == 0
    layers: int = 2            # transformer blocks
    mlp_ratio: int = 4         # MLP width = mlp_ratio * hidden
    dropout: float = 0.0
    tie_embeddings: bool = True  # output projection shares the token embedding
    qkv_bias: bool = False     # GPT-2 has one (a key bias has no gradient: nbtrain's has none)
    activation: str = "gelu"   # or "gelu_tanh" (GPT-2's gelu_new)
    ln_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"activation={self.activation!r}: use 'gelu' or 'gelu_tanh'")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        sizes = {
            "tiny": dict(hidden=64, heads=4, layers=2, seq_len=64),
            "small": dict(hidden=256, heads=8, layers=4, seq_len=128),
            "medium": dict(hidden=512, heads=8, layers=8, seq_len=256),
        }
        if name not in sizes:
            raise ValueError(f"model size {name!r}: choose one of {sorted(sizes)}")
        return cls(**{**sizes[name], **overrides})


def gpt_inits(cfg: GPTConfig):
    """The GPT's initialisation as a rule for `nbtrain.assign_inits` (a GPT built on the
    meta device, then sharded and initialised rank by rank): N(0, 0.02) weights, the
    residual projections at 0.02 / sqrt(2 * layers), zero biases, unit norms."""
    from ..zero.meta import normal_inits

    residual = 0.02 / math.sqrt(2 * cfg.layers)
    return normal_inits(0.02, scaled={"proj.weight": residual, "mlp.2.weight": residual})


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Where each token may attend in rows of packed documents.

    Args:
        position_ids: int (rows, seq), 0 where a document starts, on any device.

    Returns:
        bool (rows, 1, seq, seq) on position_ids' device: [r, 0, i, j] is True where
        j <= i and tokens i and j are in the same document (a document's id is the
        number of position-0 starts up to it along its row). Local.
    """
    doc = (position_ids == 0).cumsum(dim=1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)


def causal_attention(q, k, v, position_ids=None, dropout_p: float = 0.0):
    """Scaled dot-product attention of q, k, v (rows, heads, seq, head_dim): causal over
    each row, or with position_ids (rows, seq) causal within each packed document."""
    if position_ids is None:  # one sequence per row: the fused causal kernel, no mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    mask = document_causal_mask(position_ids.to(q.device, non_blocking=True))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def check_position_ids(position_ids, idx):
    """Raises if position_ids (when given) is not an integer tensor shaped like idx."""
    if position_ids is None:
        return
    if position_ids.dtype.is_floating_point or tuple(position_ids.shape) != tuple(idx.shape):
        raise ValueError(f"position_ids must be integers shaped like the token ids "
                         f"{tuple(idx.shape)}; got {position_ids.dtype} of shape "
                         f"{tuple(position_ids.shape)}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x, position_ids=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = causal_attention(q, k, v, position_ids,
                             dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def embed(tok: nn.Module, pos: nn.Module, idx, position_ids=None):
    """Token plus position embeddings (rows, seq, hidden): positions 0..seq-1 on every
    row, or position_ids (each packed document's from 0)."""
    if position_ids is None:
        return tok(idx) + pos(torch.arange(idx.shape[1], device=idx.device))
    x = tok(idx)
    if x.shape[0] != position_ids.shape[0]:
        raise NotImplementedError(
            "position_ids with the sequence-parallel tensor-parallel layout (the token "
            "embedding returns this rank's rows only): use gpt_plan(cfg) without "
            "sequence_parallel for packed documents")
    return x + pos(position_ids)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        gelu = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden), gelu,
                                 nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden))

    def forward(self, x, position_ids=None):
        # Without position_ids the call is the one-argument call it always was, so an
        # attention swapped in by other code (benchmarks) keeps working.
        h = self.ln1(x)
        x = x + (self.attn(h) if position_ids is None else self.attn(h, position_ids))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (B, T) int64, optional position_ids (B, T) int64 (packed documents, see
    the module docstring) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, position_ids=None):
        if idx.dtype.is_floating_point or idx.dim() != 2:
            raise TypeError(f"GPT takes token ids of shape (batch, seq) and an integer dtype; "
                            f"got {idx.dtype} of shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.cfg.seq_len}")
        check_position_ids(position_ids, idx)
        # Token ids from anywhere (a CPU data loader) meet the weights on their device.
        idx = idx.to(self.tok.weight.device, non_blocking=True)
        if position_ids is not None:
            position_ids = position_ids.to(idx.device, non_blocking=True)
        x = embed(self.tok, self.pos, idx, position_ids)
        for layer in self.layers:
            x = layer(x) if position_ids is None else layer(x, position_ids)
        return self.head(self.ln_f(x))

    def loss(self, idx, target, position_ids=None):
        logits = self(idx, position_ids)
        target = target.to(logits.device, non_blocking=True)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
