"""A small GPT (nanoGPT-shaped) used by the demo, tutorials, tests and benchmarks.

Plain PyTorch: `wrap(GPT(cfg))` shards it, `GPT(cfg)` alone is the single-process
reference every sharded result is compared with.
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

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")

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


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)  # a key bias has no gradient
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
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

    def forward(self, idx):
        if idx.dtype.is_floating_point or idx.dim() != 2:
            raise TypeError(f"GPT takes token ids of shape (batch, seq) and an integer dtype; "
                            f"got {idx.dtype} of shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.cfg.seq_len}")
        # Token ids from anywhere (a CPU data loader) meet the weights on their device.
        idx = idx.to(self.tok.weight.device, non_blocking=True)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))

    def loss(self, idx, target):
        logits = self(idx)
        target = target.to(logits.device, non_blocking=True)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
