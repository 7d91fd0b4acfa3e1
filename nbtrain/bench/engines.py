"""The four engines the benchmark compares, built from one seeded GPT.

Each builder returns the model to train; all four train with torch.optim.AdamW
and the same fp32 dtype policy. Wire bytes are counted per rank as a ring moves
them (a buffer of B bytes costs B x (N-1)/N for an all-gather or reduce-scatter,
twice that for an all-reduce): nbtrain's own collectives count themselves
(nbtrain.comm.COUNTERS); FSDP2's collectives are counted by wrapping the
torch.distributed functions it calls; DDP's by a communication hook on its
gradient buckets. All three are measured, none is the theory.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nbtrain as nbt
from nbtrain.comm import COUNTERS
from nbtrain.models import GPT, GPTConfig

ENGINES = ("zero3", "zero2", "fsdp2", "ddp")
NBTRAIN_ENGINES = ("zero3", "zero2", "nbtrain_tp")  # their collectives count themselves


class WireBytes:
    """Bytes this rank sent through collectives that nbtrain does not route."""

    def __init__(self):
        self._lock = threading.Lock()
        self.total = 0

    def add(self, nbytes: float) -> None:
        with self._lock:
            self.total += int(nbytes)


WIRE = WireBytes()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count_torch_collectives(world: int) -> None:
    """Wraps the collectives FSDP2 calls so their bytes are counted.

    torch 2.13 names them all_gather_single / reduce_scatter_single (the older
    *_into_tensor / *_tensor names call those); earlier releases have only the older
    names. Wrap one name of each pair, so nothing is counted twice.
    """
    ring = (world - 1) / world
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter_name = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                    else "reduce_scatter_tensor")
    gather, scatter, reduce = getattr(dist, gather_name), getattr(dist, scatter_name), dist.all_reduce

    def all_gather_flat(output, input, *a, **kw):  # noqa: A002 (torch's name)
        WIRE.add(_nbytes(output) * ring)
        return gather(output, input, *a, **kw)

    def reduce_scatter_flat(output, input, *a, **kw):  # noqa: A002
        WIRE.add(_nbytes(input) * ring)
        return scatter(output, input, *a, **kw)

    def all_reduce(tensor, *a, **kw):
        WIRE.add(2 * _nbytes(tensor) * ring)
        return reduce(tensor, *a, **kw)

    setattr(dist, gather_name, all_gather_flat)
    setattr(dist, scatter_name, reduce_scatter_flat)
    dist.all_reduce = all_reduce


def _ddp_counting_hook(world: int):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ring = (world - 1) / world

    def hook(state, bucket):
        WIRE.add(2 * _nbytes(bucket.buffer()) * ring)
        return allreduce_hook(state, bucket)
    return hook


def plain_gpt(cfg: GPTConfig, seed: int, device: torch.device) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def fsdp2_mesh():
    """A one-dimensional device mesh over the default group, on nbtrain's device type.
    Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    ctx = nbt.get_context()
    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def fully_shard_gpt(model: GPT, mesh) -> nn.Module:
    """FSDP2 over `mesh`: each transformer layer, then the root (embeddings, final norm,
    head). The model may be on the meta device (then `to_empty` and initialise it).
    Collective."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:  # one group per layer, as nbtrain's one Block per layer
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build(engine: str, cfg: GPTConfig, seed: int) -> nn.Module:
    """The model for `engine`, sharded or replicated over the default group.

    Collective: every rank calls this with the same arguments.
    """
    ctx = nbt.get_context()
    model = plain_gpt(cfg, seed, ctx.device)
    if engine in ("zero3", "zero2"):
        return nbt.wrap(model, zero_level=3 if engine == "zero3" else 2)
    if engine == "fsdp2":
        _count_torch_collectives(ctx.world_size)
        return fully_shard_gpt(model, fsdp2_mesh())
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids)
        ddp.register_comm_hook(None, _ddp_counting_hook(ctx.world_size))
        return ddp
    raise ValueError(f"engine {engine!r}: choose one of {ENGINES}")


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def reset_wire() -> None:
    COUNTERS.reset()
    WIRE.total = 0


def wire_bytes(engine: str) -> int:
    """Bytes this rank moved since `reset_wire()`."""
    return COUNTERS.snapshot()["total_bytes"] if engine in NBTRAIN_ENGINES else WIRE.total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 holds DTensors


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds.

    Counts what is resident at rest (after a step, before the next forward):
    nbtrain's flat shards and DistributedParameter shards, FSDP2's local DTensor
    shards, DDP's full replicas; each with its gradient and AdamW's exp_avg and
    exp_avg_sq.
    """
    params = grads = optim = 0
    for p in {id(p): p for p in model.parameters()}.values():
        params += _nbytes(_local(p))
        for g in (p.grad, getattr(p, "main_grad", None)):
            if g is not None:
                grads += _nbytes(_local(g))
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.dim() > 0:
                optim += _nbytes(_local(v))
    return {"param": params, "grad": grads, "optim": optim, "total": params + grads + optim}
