"""A small GPT (nanoGPT-shaped) used by the demo, tutorials, tests and benchmarks.

Plain PyTorch: `wrap(GPT(cfg))` shards it, `GPT(cfg)` alone is the single-process
reference every sharded result is compared with.

Packed documents: `model(idx, position_ids)` with position_ids (rows, seq) restarting
at 0 where each document starts (Hugging Face's packing convention) embeds each
document's positions from 0 and masks attention causally within each document, so a
row of packed documents computes what the documents would one by one. Without
position_ids a row is one causal sequence (the `is_causal` fast path).

Context parallelism: given `GPT(cfg, context_parallel=cp)`, a
`nbtrain.context_parallel.ContextParallel` (`ContextParallel.from_topology()` for the cp
group of `nbtrain.init_distributed(cp_size=...)`), each rank of the cp group holds a
shard of every sequence, and the GPT takes that shard. Attention runs as ring attention
over the group (nbtrain.context_parallel.ring_attention), the position embedding reads
each token's global position, and packed documents are masked by document ids taken
from the full rows. Without one (the default, whatever the topology) a GPT computes on
whole sequences; `model.context_parallel` may be set later. A training step:

    idx, targets, position_ids, doc_ids = model.shard_batch(idx, targets, position_ids)
    loss = model.loss(idx, targets, position_ids, doc_ids)  # mean over this rank's tokens

Every rank holds as many tokens as its peers, so the data-parallel average of the
gradients (`wrap` averages over the dp group, which holds the cp ranks) is the
gradient of the full-sequence mean: no extra reduction. Without context parallelism
the GPT is the plain model, unchanged.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import check_position_ids

# A private name here: `nbtrain.models.gpt.ContextParallel` is the deprecated path that
# module __getattr__ (at the end) serves with a FutureWarning.
from ..context_parallel.model import ContextParallel as _ContextParallel

TOPOLOGY = "topology"  # deprecated GPT.context_parallel value: read nbtrain's topology


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens by default
    seq_len: int = 64  # longest sequence (positions embedded)
    hidden: int = 64  # model width
    heads: int = 4  # attention heads; hidden % heads == 0
    layers: int = 2  # transformer blocks
    mlp_ratio: int = 4  # MLP width = mlp_ratio * hidden
    dropout: float = 0.0
    tie_embeddings: bool = True  # output projection shares the token embedding
    qkv_bias: bool = False  # GPT-2 has one (a key bias has no gradient: nbtrain's has none)
    activation: str = "gelu"  # or "gelu_tanh" (GPT-2's gelu_new)
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
    from ..zero import normal_inits

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


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x, position_ids=None, cp: _ContextParallel | None = None, doc_ids=None):
        """Under `cp`, x is this rank's shard and attention runs around the cp ring
        (doc_ids: the shard's document ids, see ContextParallel.shard_batch)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if cp is not None:
            y = cp.attention(q, k, v, doc_ids)
        else:
            y = causal_attention(
                q, k, v, position_ids, dropout_p=self.dropout if self.training else 0.0
            )
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
            "sequence_parallel for packed documents"
        )
    return x + pos(position_ids)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        gelu = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden),
            gelu,
            nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden),
        )

    def forward(self, x, position_ids=None, cp: _ContextParallel | None = None, doc_ids=None):
        # Without position_ids the call is the one-argument call it always was, so an
        # attention swapped in by other code (benchmarks) keeps working.
        h = self.ln1(x)
        if cp is not None:
            if type(self.attn).forward is not Attention.forward:
                raise NotImplementedError(
                    f"context parallelism with {type(self.attn).__name__} (tensor-parallel or "
                    "swapped-in attention): only the GPT's own Attention runs ring "
                    "attention; use tp_size=1 with cp_size > 1"
                )
            x = x + self.attn(h, cp=cp, doc_ids=doc_ids)
        else:
            x = x + (self.attn(h) if position_ids is None else self.attn(h, position_ids))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (B, T) int64, optional position_ids (B, T) int64 (packed documents, see
    the module docstring) -> logits (B, T, vocab).

    `context_parallel`: a `nbtrain.context_parallel.ContextParallel`, or None (the
    default: whole sequences, whatever nbtrain's topology). Under cp, T is this rank's
    shard (see `shard_batch`) and the logits are the shard's. The attribute of the same
    name may be changed later.
    """

    def __init__(self, cfg: GPTConfig, context_parallel: _ContextParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.context_parallel = context_parallel
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

    def active_cp(self) -> _ContextParallel | None:
        """The context parallelism the next forward runs under (None: whole sequences)."""
        setting = self.context_parallel
        if isinstance(setting, str):
            if setting != TOPOLOGY:
                raise ValueError(
                    f"GPT.context_parallel={setting!r}: use a ContextParallel "
                    "(ContextParallel.from_topology() for nbtrain's cp group) "
                    "or None"
                )
            warnings.warn(
                "GPT.context_parallel='topology' is deprecated (it reads nbtrain's "
                "topology at every forward): pass context_parallel="
                "ContextParallel.from_topology() instead",
                FutureWarning,
                stacklevel=2,
            )
            return _ContextParallel.from_topology()
        return setting

    def shard_batch(self, idx, targets=None, position_ids=None):
        """(idx, targets, position_ids, doc_ids): this rank's shard of full rows under
        context parallelism (see ContextParallel.shard_batch); without it the batch as
        given and doc_ids None. Local."""
        cp = self.active_cp()
        if cp is None:
            return idx, targets, position_ids, None
        return cp.shard_batch(idx, targets, position_ids)

    def gather_sequence(self, x, dim: int = 1):
        """The full sequence of a per-shard tensor such as the logits (no autograd);
        without context parallelism x itself, detached. Collective over the cp group."""
        cp = self.active_cp()
        return x.detach() if cp is None else cp.gather(x, dim)

    def forward(self, idx, position_ids=None, doc_ids=None):
        if idx.dtype.is_floating_point or idx.dim() != 2:
            raise TypeError(
                f"GPT takes token ids of shape (batch, seq) and an integer dtype; "
                f"got {idx.dtype} of shape {tuple(idx.shape)}"
            )
        cp = self.active_cp()
        if cp is not None:
            return self._forward_shard(idx, position_ids, doc_ids, cp)
        if doc_ids is not None:
            raise ValueError(
                "GPT: doc_ids are for context parallelism (shard_batch makes "
                "them); on whole sequences the documents come from "
                "position_ids: drop doc_ids"
            )
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

    def _forward_shard(self, idx, position_ids, doc_ids, cp: _ContextParallel):
        """This rank's shard of each row: global positions, ring attention."""
        cp.check_local(idx, position_ids, doc_ids, self.cfg.seq_len)
        if self.training and self.cfg.dropout:
            raise NotImplementedError(
                f"context parallelism with dropout={self.cfg.dropout}: "
                "ring attention has no dropout; use dropout=0.0"
            )
        idx = idx.to(self.tok.weight.device, non_blocking=True)
        if position_ids is None:  # the shard's place in the full sequence
            position_ids = cp.positions(idx.shape[1], idx.device)
        else:
            position_ids = position_ids.to(idx.device, non_blocking=True)
            doc_ids = doc_ids.to(idx.device, non_blocking=True)
        x = self.tok(idx) + self.pos(position_ids)
        for layer in self.layers:
            x = layer(x, cp=cp, doc_ids=doc_ids)
        return self.head(self.ln_f(x))

    def loss(self, idx, target, position_ids=None, doc_ids=None):
        """Mean cross-entropy over the given tokens (under context parallelism, this
        rank's: every rank holds as many, so the gradients' data-parallel average is the
        full rows' mean; targets ignored with -100 would weigh the ranks unequally)."""
        logits = self(idx, position_ids) if doc_ids is None else self(idx, position_ids, doc_ids)
        target = target.to(logits.device, non_blocking=True)
        # In fp32 whatever the model's dtype: a bf16 softmax over the vocabulary rounds
        # the loss itself (5.6875 for 5.6643) and every gradient behind it.
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def __getattr__(name):
    if name == "ContextParallel":  # its home until one release ago
        warnings.warn(
            "nbtrain.models.gpt.ContextParallel moved to nbtrain.context_parallel."
            "ContextParallel; import it from there: this path goes in the next "
            "release",
            FutureWarning,
            stacklevel=2,
        )
        return _ContextParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
