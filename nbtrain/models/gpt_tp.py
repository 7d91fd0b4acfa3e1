"""Tensor parallelism for `nbtrain.models.GPT`: the plan `nbtrain.parallelize` takes.

    nbtrain.init_distributed(tp_size=2)
    model = nbtrain.parallelize(GPT(cfg), gpt_plan(cfg))

Attention heads and MLP columns split over the tp ranks, the vocabulary split for the
(tied) embedding and output projection, layer norms and position embeddings
replicated. Activations between layers are replicated (Megatron's layout) or, with
`gpt_plan(cfg, sequence_parallel=True)`, split along the batch (the replicated
layers then sum their gradients over tp). `model(idx)` and `model.loss(idx, target)`
keep their meaning: every rank passes the whole batch of its replica and the logits
come back full-width.

The plan is the layout, and applying it is the caller's choice: a `GPT(cfg)` stays
plain under `init_distributed(tp_size=2)` until `parallelize` applies `gpt_plan`. The
plan's layers split over the process's tp group, as BMTrain's `bmt.nn` layers split
over `config["tp_comm"]` (nbtrain.tensor_parallel.layers).
"""

from __future__ import annotations

from torch import nn

from ..comm.context import get_context
from ..tensor_parallel.layers import ColumnParallelLinear, slice_param
from ..tensor_parallel.parallelize import Plan, row_from, without_rng
from .gpt import GPTConfig, causal_attention


class TensorParallelAttention(nn.Module):
    """The GPT's attention with its heads split over the tp ranks (same names): the
    tp group of `init_distributed(tp_size=...)`, as nbtrain.nn's tensor-parallel layers."""

    def __init__(self, attention: nn.Module, sequence_parallel: bool = False):
        super().__init__()
        topo = get_context().topology
        size, rank = topo.tp_size, topo.tp_rank
        if attention.heads % size:
            raise ValueError(
                f"attention has {attention.heads} heads, which tp_size {size} "
                "does not divide: choose a tp_size that divides the head count"
            )
        self.heads, self.dropout = attention.heads // size, attention.dropout
        qkv = attention.qkv
        layer = without_rng(
            lambda: ColumnParallelLinear(
                qkv.in_features,
                qkv.out_features,
                bias=qkv.bias is not None,
                dtype=qkv.weight.dtype,
                gather_input=sequence_parallel,
            )
        )
        # q, k and v are three parts of the fused weight: each is split by heads.
        layer.weight = slice_param(qkv.weight.data, 0, size, rank, groups=3)
        if qkv.bias is not None:
            layer.bias = slice_param(qkv.bias.data, 0, size, rank, groups=3)
        self.qkv = layer.to(qkv.weight.device)
        self.proj = row_from(attention.proj, all_reduce_output=not sequence_parallel)

    def forward(self, x, position_ids=None):
        return local_heads_attention(self, x, position_ids)


def local_heads_attention(attn: nn.Module, x, position_ids=None):
    """Causal attention over this rank's heads: `attn.qkv(x)` gives (b, t, 3 * c / tp),
    this rank's q, k and v heads back to back; `attn.proj` takes their outputs.
    position_ids (b, t), 0 where each packed document starts, confine each token to
    its own document (every tp rank passes the same, whole-batch ids: attention sees
    all rows, sequence parallel included)."""
    local = attn.qkv(x)  # all rows (sequence parallel: gathered from the token slices)
    b, t, _ = local.shape
    q, k, v = local.split(local.shape[-1] // 3, dim=2)
    q, k, v = (z.view(b, t, attn.heads, -1).transpose(1, 2) for z in (q, k, v))
    y = causal_attention(q, k, v, position_ids, dropout_p=attn.dropout if attn.training else 0.0)
    return attn.proj(y.transpose(1, 2).reshape(b, t, -1))


def gpt_plan(cfg: GPTConfig, sequence_parallel: bool = False) -> Plan:
    """The tensor-parallel plan for a GPT built from `cfg`, in Megatron's layout or
    (`sequence_parallel=True`) with activations split along the batch between layers
    (the batch must then divide by tp_size)."""

    def attention(module, name):
        return TensorParallelAttention(module, sequence_parallel)

    styles = {
        "tok": "vocab",
        "pos": "replicated",
        "layers.*.ln1": "replicated",
        "layers.*.ln2": "replicated",
        "layers.*.attn": attention,
        "layers.*.mlp.0": "colwise",
        "layers.*.mlp.2": "rowwise",
        "ln_f": "replicated",
        "head": "tied_head" if cfg.tie_embeddings else "head",
    }
    return Plan(styles, sequence_parallel)
