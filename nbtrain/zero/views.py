"""Whole-model operations on sharded state: deferred initialisation, gathered gradients."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from ..tensor_parallel.slices import full_from_slice
from .block import Block
from .init import HeldElsewhere, draw_full, init_range
from .parameter import DistributedParameter, group_of
from .partition import shard_range
from .placement import is_slice, placement_of


def full_named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gathered gradients under the plain model's names (tensor-parallel slices
    gathered into their full tensors). Collective.

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
            grad = (
                _gather_grad(param)
                if isinstance(param, DistributedParameter)
                else param.grad.detach().clone()
            )
            # A tensor-parallel slice's gradient: the full one, gathered over tp.
            placed = placement_of(param)
            out[base + name] = full_from_slice(grad, placed) if placed.slice_group else grad
    return out


def _gather_grad(param: DistributedParameter) -> torch.Tensor:
    ranks = group_of(param)
    flat = torch.empty(param.numel() * ranks.size, dtype=param.grad.dtype, device=param.device)
    C.all_gather(flat, param.grad.detach(), group=ranks.group, label="param.grad")
    return flat[: param.full_numel].view(param.full_shape).clone()


def init_parameters(model: nn.Module, by_name: bool = False) -> None:
    """Runs every deferred `init_method` (BMTrain's `init_parameters`).

    As BMTrain does, by default: each parameter's initialiser runs on a full tensor
    from the current torch generator, in the model's parameter order, on every rank
    (another pipeline stage's layers too), and each rank keeps its part; the same
    seed gives a plain model's weights. `by_name=True` draws only this rank's part,
    from generators seeded by the parameter's name (zero/init.py). Every rank calls
    it, with its generator in the same state; nothing is communicated.
    """
    get_context()  # before init_distributed: its clear error, not one from deep inside
    for prefix, module in _init_walk(model, ""):
        if isinstance(module, HeldElsewhere):
            if not by_name:
                module.draw()
            continue
        if isinstance(module, Block):
            module.init_parameters(prefix, by_name=by_name)
            continue
        for name, param in module._parameters.items():
            if isinstance(param, DistributedParameter) and param.init_method is not None:
                _init_distributed_parameter(prefix + name, param, by_name)


def init_distributed_parameter(params) -> None:
    """Runs the `init_method` of every DistributedParameter among `params` that has
    one (BMTrain's `param_init.init_distributed_parameter`): drawn whole from the
    current generator, this rank keeping its shard. Local; every rank calls it alike."""
    for param in params:
        if isinstance(param, DistributedParameter) and param.init_method is not None:
            _init_distributed_parameter("", param, by_name=False)


def _init_walk(module: nn.Module, prefix: str, seen=None):
    """(prefix, module) in named_modules' order, a Block's insides left to the Block,
    and a module with `_init_children()` (a pipeline's block list: every layer, the
    other stages' as HeldElsewhere) walked through those."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    if isinstance(module, (Block, HeldElsewhere)):
        return
    children = getattr(module, "_init_children", None)
    for name, child in children() if children is not None else module.named_children():
        if child is not None:
            yield from _init_walk(child, f"{prefix}{name}.", seen)


def _init_distributed_parameter(name: str, param: DistributedParameter, by_name: bool) -> None:
    ranks = group_of(param)
    begin, end = shard_range(param.full_numel, ranks.size, ranks.rank)
    stop = min(end, param.full_numel)
    if by_name:
        if stop <= begin:
            return
        values = init_range(
            name, param.full_shape, param.dtype, param.device, param.init_method, begin, stop
        )
    else:  # every rank draws the whole parameter, its shard empty or not
        tp_meta = placement_of(param) if is_slice(param) else None
        full = draw_full(param.full_shape, param.dtype, param.device, param.init_method, tp_meta)
        if stop <= begin:
            return
        values = full[begin:stop]
    with torch.no_grad():
        param.data[: stop - begin].copy_(values)


def state_keys(model: nn.Module) -> list[str]:
    """The keys `model.state_dict()` would have, without gathering anything. Local."""
    keys = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        base = prefix + "." if prefix else ""
        if isinstance(module, Block):  # its flat buffers stand for the names below
            keys += [base + n for g in module.groups for e in g.entries for n in e.names]
        else:
            keys += [base + n for n, p in module._parameters.items() if p is not None]
        keys += [
            base + n
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return list(dict.fromkeys(keys))


def full_items_by_parameter(block: Block, prefix: str = ""):
    """(name, full tensor) of a Block's parameters, one parameter at a time: each rank
    broadcasts its part of it, so a rank holds one parameter gathered, not a flat
    buffer (a flat buffer holding tensor-parallel slices is gathered whole: its slices
    are assembled over tp); a caller that drops each tensor before taking the next
    holds one at a time. Collective over each flat buffer's ranks, iterated in step."""
    from ..comm.topology import ALONE

    for group in block.groups:
        ranks = group.ranks
        if ranks.size == 1 or ranks.group is ALONE or any(e.tp is not None for e in group.entries):
            yield from block.full_items(prefix, copy=False, groups=[group])
            continue
        sources = [C.global_rank(ranks.group, r) for r in range(ranks.size)]
        shard = group.shard.detach()
        for slot, entry in zip(group.layout.slots, group.entries):
            out = torch.empty(slot.numel, dtype=shard.dtype, device=group.device)
            for r, src in enumerate(sources):
                begin, end = group.layout.shard_range(r)
                part = slot.local_part(begin, end)
                if part is None:
                    continue
                lo, hi = part
                piece = out[lo - slot.offset : hi - slot.offset]
                if r == ranks.rank:
                    piece.copy_(shard[lo - begin : hi - begin])
                C.broadcast(piece, src=src, group=ranks.group, label=f"{group.label}.save")
            value = out.view(slot.shape)
            for name in entry.names:
                yield prefix + name, value
            del out, value
