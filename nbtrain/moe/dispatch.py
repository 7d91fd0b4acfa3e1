"""Moving token rows between the ranks of an expert-parallel (ep) group.

`all_to_all_rows` is the differentiable uneven all_to_all the layer's dispatch and
combine use (through nbtrain.comm.collectives, so the byte counters see it); `_ep_group`
resolves a layer's `group=` argument (None: the topology's "ep" group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives, context
from ..comm.topology import ALONE


class _AllToAll(torch.autograd.Function):
    """Rows of uneven sizes to every ep rank; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group, label):
        ctx.splits, ctx.group, ctx.label = (out_splits, in_splits), group, label
        out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
        collectives.all_to_all_single(out, rows.contiguous(), out_splits, in_splits,
                                      group=group, label=label)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        collectives.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits,
                                      group=ctx.group, label=ctx.label + " backward")
        return grad_in, None, None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group=None, label: str = "moe") -> torch.Tensor:
    """Differentiable uneven all_to_all of (sum(in_splits), ...) rows ->
    (sum(out_splits), ...). Collective over `group`."""
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group, label)


def _topology_ep():
    """The ep group of nbtrain's topology (None: the world), or False when nbtrain has
    made no context."""
    return context.get_context().topology.group("ep") if context.is_initialized() else False


def _ep_group(group):
    """(group, size, rank): a one-rank group, or no process group at all, is ALONE.
    None is the topology's ep group (the world before `init_distributed`)."""
    if group is ALONE or not dist.is_initialized():
        return ALONE, 1, 0
    topology_ep = _topology_ep() if group is None else False
    if topology_ep is not False:
        group = topology_ep
        if group is ALONE:
            return ALONE, 1, 0
    size = dist.get_world_size(group)
    return (ALONE, 1, 0) if size == 1 else (group, size, dist.get_rank(group))


def _is_topology_ep(group) -> bool:
    """Whether `group` is the ep group of nbtrain's topology: only then are the experts
    slices that state dicts gather and `wrap` shards (over the topology's edp group).
    Experts over another group stay this rank's own (local in state dicts)."""
    topology_ep = _topology_ep()
    return topology_ep is not False and group is topology_ep
