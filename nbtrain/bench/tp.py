"""`nbtrain bench --tp-size T`: nbtrain's tensor parallelism against torch's DTensor
`parallelize_module`, on the same GPT with the same plan, in the same run.

The plan is Megatron's (activations replicated on every tp rank): attention heads and
MLP columns split, the vocabulary split for the embedding and the tied output
projection, whose logits are gathered to full width. nbtrain runs
`parallelize(GPT, gpt_plan)` then `wrap()` (ZeRO-3: the slices over their
data-parallel group, the replicated norms and position embedding over the world);
DTensor runs ColwiseParallel / RowwiseParallel on the same modules, its fused q,k,v
weight permuted so each rank's contiguous rows are its heads' q, k and v.

Wire bytes: nbtrain's collectives count themselves. DTensor's go through torch's
functional collectives, which no torch.distributed wrapper sees; they are counted by
a dispatch mode during the first (untimed) step, and that count stands for every
step (the step is the same each time). Both are compared with the Megatron count:
per layer two all-reduces of the activations forward and two backward, one for
the embedding and one for the head's input, and the all-gather of the logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nbtrain as nbt
from nbtrain.models import GPTConfig
from nbtrain.models.gpt_tp import gpt_plan, local_heads_attention
from nbtrain.tensor_parallel.slices import cut

from . import engines

TP_ENGINES = ("nbtrain_tp", "dtensor_tp")
BYTES_PER_ELEMENT = 4


def build(engine: str, cfg: GPTConfig, seed: int) -> nn.Module:
    """The tensor-parallel model for `engine` (the topology's tp size). Collective."""
    ctx = nbt.get_context()
    model = engines.plain_gpt(cfg, seed, ctx.device)
    if engine == "nbtrain_tp":
        return nbt.wrap(nbt.parallelize(model, gpt_plan(cfg)), zero_level=3)
    if engine == "dtensor_tp":
        return _dtensor(model, cfg, ctx.topology.tp_size, ctx.device)
    raise ValueError(f"engine {engine!r}: choose one of {TP_ENGINES}")


class _LocalHeads(nn.Module):
    """The GPT's attention for DTensor: q,k,v rows grouped by rank, local heads."""

    def __init__(self, attention: nn.Module, tp: int):
        super().__init__()
        self.heads, self.dropout = attention.heads // tp, attention.dropout
        self.qkv, self.proj = attention.qkv, attention.proj
        weight = attention.qkv.weight.data
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([cut(weight, 0, tp, r, groups=3) for r in range(tp)]))

    def forward(self, x):
        return local_heads_attention(self, x)


def _dtensor(model: nn.Module, cfg: GPTConfig, tp: int, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if cfg.heads % tp:
        raise ValueError(f"heads={cfg.heads} must divide by tp_size {tp}")
    mesh = init_device_mesh(device.type, (tp,))
    for layer in model.layers:
        layer.attn = _LocalHeads(layer.attn, tp)
        parallelize_module(
            layer,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(),
            },
        )
    parallelize_module(
        model,
        mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if cfg.tie_embeddings:  # each module got its own copy; tie them again
        model.head.weight = model.tok.weight
    return model


class FunctionalCollectiveBytes(TorchDispatchMode):
    """Counts the ring bytes of torch's functional collectives (what DTensor issues)."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.total = world, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "_c10d_functional." in name and args and torch.is_tensor(args[0]):
            nbytes, world = args[0].numel() * args[0].element_size(), self.world
            if "all_reduce" in name:  # the buffer, twice (N-1)/N
                self.total += 2 * nbytes * (world - 1) / world
            elif "all_gather" in name:  # the input is one rank's shard
                self.total += nbytes * (world - 1)
            elif "reduce_scatter" in name:  # the input is the full buffer
                self.total += nbytes * (world - 1) / world
        return out


def megatron_bytes(cfg: GPTConfig, batch: int, tp: int) -> float:
    """Ring bytes per rank per step of Megatron-style tp on this GPT (fp32)."""
    ring = (tp - 1) / tp
    act = batch * cfg.seq_len * cfg.hidden * BYTES_PER_ELEMENT
    all_reduces = 4 * cfg.layers + 2
    logits = batch * cfg.seq_len * cfg.vocab_size * BYTES_PER_ELEMENT
    return all_reduces * 2 * act * ring + logits * ring


def theory(cfg: GPTConfig, batch: int, tp: int, dp: int, param_numel: int) -> dict:
    """Model state at rest (16 bytes x params / (tp x dp)) and the Megatron wire count."""
    return {
        "state_bytes": 16 * param_numel / (tp * dp),
        "wire_bytes": megatron_bytes(cfg, batch, tp),
    }
