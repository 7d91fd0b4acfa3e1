"""The four engines the benchmark compares, built from one seeded GPT.

Each builder returns the model to train, `optimizer` its AdamW. In fp32 all four
train with torch.optim.AdamW. In bf16 (`DTYPES`) each runs its own mixed-precision
recipe for one numerical policy: bf16 weights and activations in forward and
backward, gradients reduced in fp32, AdamW on fp32 master weights:
  zero3/zero2  bf16 parameters in the Blocks, `wrap(..., reduce_dtype=torch.float32)`
               (each shard's fp32 `main_grad`), nbtrain's AdamOptimizer (fp32 master)
  fsdp2        fp32 sharded parameters (the master) with MixedPrecisionPolicy(
               param_dtype=bf16, reduce_dtype=fp32), torch AdamW on the fp32 shards
  ddp          a bf16 replica whose gradient buckets are all-reduced in fp32 (a comm
               hook; the average is rounded back into the bf16 bucket), torch AdamW on
               fp32 master copies (`MasterAdamW`)
Wire bytes are counted per rank as a ring moves
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RECIPES = {  # what each engine runs in bf16, for the printed header
    "zero3": "bf16 Blocks, fp32 reduce-scatter (main_grad), AdamOptimizer fp32 master",
    "zero2": "bf16 Blocks, fp32 reduce-scatter (main_grad), AdamOptimizer fp32 master",
    "fsdp2": "fp32 shards, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW",
    "ddp": "bf16 replica, fp32 all-reduce hook, AdamW on fp32 master copies",
}
ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
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
    gather_name = (
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )
    scatter_name = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    gather, scatter, reduce = (
        getattr(dist, gather_name),
        getattr(dist, scatter_name),
        dist.all_reduce,
    )

    def all_gather_flat(output_tensor, input_tensor, *a, **kw):
        WIRE.add(_nbytes(output_tensor) * ring)
        return gather(output_tensor, input_tensor, *a, **kw)

    def reduce_scatter_flat(output, input, *a, **kw):  # noqa: A002 (torch's keyword names)
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


def _ddp_fp32_hook(world: int):
    """All-reduces a bf16 bucket in fp32 (the average rounded back into the bucket): the
    same reduction precision and wire bytes as the other engines' fp32 reduce."""
    ring = (world - 1) / world

    def hook(state, bucket):
        buffer = bucket.buffer()
        wide = buffer.float().div_(world)
        WIRE.add(2 * _nbytes(wide) * ring)
        fut = dist.all_reduce(wide, group=state, async_op=True).get_future()
        return fut.then(lambda f: buffer.copy_(f.value()[0]))

    return hook


class MasterAdamW(torch.optim.AdamW):
    """torch AdamW on fp32 master copies of a bf16 model's parameters: each step reads
    the model's gradients, updates the masters and writes them back rounded to bf16."""

    def __init__(self, params, **kw):
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().requires_grad_() for p in self.model_params]
        super().__init__(self.masters, **kw)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for p, master in zip(self.model_params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, master in zip(self.model_params, self.masters):
            p.copy_(master)
            master.grad = None  # at rest only the bf16 gradients remain
        return loss


def plain_gpt(cfg: GPTConfig, seed: int, device: torch.device) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def fsdp2_mesh():
    """A one-dimensional device mesh over the default group, on nbtrain's device type.
    Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    ctx = nbt.get_context()
    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def fully_shard_gpt(model: GPT, mesh, mp_policy=None) -> nn.Module:
    """FSDP2 over `mesh`: each transformer layer, then the root (embeddings, final norm,
    head). The model may be on the meta device (then `to_empty` and initialise it).
    Collective."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):  # one group per layer, as nbtrain's Blocks
        # The last layer stays gathered into backward, which starts with it: the
        # recipe torchtitan uses, and what nbtrain's last Block of a list does.
        fully_shard(layer, mesh=mesh, reshard_after_forward=i < last, **policy)
    return fully_shard(model, mesh=mesh, **policy)


def compile_layers(layers: nn.ModuleList, options: dict) -> None:
    """Replaces each layer by `torch.compile(layer, **options)`, in place: the layer's
    own forward is compiled, and what a wrapper hooks around the layer (FSDP2's gather
    and reduce-scatter) stays eager outside it, as around a compiled nbtrain Block
    (`wrap(..., compile=options)`). Layers of one class share the compiled code. Local."""
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, **options)


def build(
    engine: str, cfg: GPTConfig, seed: int, dtype: str = "fp32", compile_options: dict | None = None
) -> nn.Module:
    """The model for `engine`, sharded or replicated over the default group, in the
    engine's recipe for `dtype` ("fp32" or "bf16", see the module docstring). With
    `compile_options` (torch.compile's keywords) each transformer layer is compiled, the same
    way for every engine: nbtrain's Blocks compile their module, the peers' layers are
    compiled before FSDP2 or DDP wraps them.

    Collective: every rank calls this with the same arguments.
    """
    ctx = nbt.get_context()
    model = plain_gpt(cfg, seed, ctx.device)
    half = dtype == "bf16"
    if engine in ("zero3", "zero2"):
        kw = {"zero_level": 3 if engine == "zero3" else 2}
        if compile_options is not None:
            kw["compile"] = compile_options
        if half:
            return nbt.wrap(model.to(torch.bfloat16), reduce_dtype=torch.float32, **kw)
        return nbt.wrap(model, **kw)
    if compile_options is not None:
        compile_layers(model.layers, compile_options)
    if engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        _count_torch_collectives(ctx.world_size)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if half
            else None
        )
        return fully_shard_gpt(model, fsdp2_mesh(), policy)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DDP(model.to(torch.bfloat16) if half else model, device_ids=ids)
        hook = _ddp_fp32_hook if half else _ddp_counting_hook
        ddp.register_comm_hook(None, hook(ctx.world_size))
        return ddp
    raise ValueError(f"engine {engine!r}: choose one of {ENGINES}")


def optimizer(engine: str, model: nn.Module, dtype: str = "fp32") -> torch.optim.Optimizer:
    """The engine's AdamW (same hyperparameters everywhere): torch's in fp32; in bf16
    the engine's fp32-master recipe (see the module docstring). Local."""
    if dtype == "bf16" and engine in NBTRAIN_ENGINES:
        # AdamW, as the other engines': decoupled decay (BMTrain's rule for bf16 too).
        return nbt.optim.AdamOptimizer(model.parameters(), decoupled_weight_decay=True, **ADAMW)
    if dtype == "bf16" and engine == "ddp":
        return MasterAdamW(model.parameters(), **ADAMW)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, computed in fp32 whatever the logits' dtype."""
    logits = model(x).float()
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
    shards, DDP's full replicas; each with its gradient (and fp32 `main_grad`) and
    the optimizer's state: AdamW's exp_avg and exp_avg_sq, and fp32 master weights
    where the optimizer keeps them (AdamOptimizer's "master", MasterAdamW's copies).
    """
    params = grads = optim = 0
    for p in {id(p): p for p in model.parameters()}.values():
        params += _nbytes(_local(p))
        for g in (p.grad, getattr(p, "main_grad", None)):
            if g is not None:
                grads += _nbytes(_local(g))
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                optim += _nbytes(_local(v))
    optim += sum(_nbytes(m) for m in getattr(opt, "masters", ()))
    return {"param": params, "grad": grads, "optim": optim, "total": params + grads + optim}
