"""Whole-model operations on sharded state: deferred initialisation, gathered gradients."""
from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from .block import Block
from .init import init_range
from .parameter import DistributedParameter
from .partition import shard_range


def full_named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered gradients under the plain model's names. Collective.

    Parameters without a gradient are left out.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        base = prefix + "." if prefix else ""
        if isinstance(module, Block):
            out.update(module.full_named_grads(base))
            continue
        for name, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if param.grad is None:
                continue
            if isinstance(param, DistributedParameter):
                out[base + name] = _gather_grad(param)
            else:
                out[base + name] = param.grad.detach().clone()
    return out


def _gather_grad(param: DistributedParameter) -> torch.Tensor:
    world = get_context().world_size
    flat = torch.empty(param.numel() * world, dtype=param.grad.dtype, device=param.device)
    C.all_gather(flat, param.grad.detach(), label="param.grad")
    return flat[: param.full_numel].view(param.full_shape).clone()


def init_parameters(model: nn.Module) -> None:
    """Runs every deferred `init_method` (BMTrain's `init_parameters`).

    Every rank computes only its own shard (see the module docstring); the
    gathered model is the same at every world size. Collective-free.
    """
    ctx = get_context()
    for prefix, module in model.named_modules():
        base = prefix + "." if prefix else ""
        if isinstance(module, Block):
            module.init_parameters(base)
            continue
        for name, param in module._parameters.items():
            if isinstance(param, DistributedParameter) and param.init_method is not None:
                begin, end = shard_range(param.full_numel, ctx.world_size, ctx.rank)
                stop = min(end, param.full_numel)
                if stop > begin:
                    values = init_range(base + name, param.full_shape, param.dtype,
                                        param.device, param.init_method, begin, stop)
                    with torch.no_grad():
                        param.data[: stop - begin].copy_(values)
