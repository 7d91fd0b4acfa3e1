"""Whole-model views of sharded state, for tests, inspection and checkpoints."""
from __future__ import annotations

import torch
from torch import nn

from .block import Block
from .parameter import DistributedParameter


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
    from ..comm import collectives as C
    from ..comm.context import get_context

    world = get_context().world_size
    flat = torch.empty(param.numel() * world, dtype=param.grad.dtype, device=param.device)
    C.all_gather(flat, param.grad.detach(), label="param.grad")
    return flat[: param.full_numel].view(param.full_shape).clone()
