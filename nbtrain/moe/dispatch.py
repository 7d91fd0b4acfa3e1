"""Moving token rows between the ranks of an expert-parallel (ep) group.

`all_to_all_rows` is the differentiable uneven all_to_all the layer's dispatch and
combine use (through nbtrain.comm.collectives, so the byte counters see it);
`ExpertParallel` is the layout a caller gives a layer (`ExpertParallel.from_topology()`
for the ep group of `init_distributed(ep_size=...)`), and `_ep_group` resolves a layer's
`group=` argument (None: every expert local, whatever the topology).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

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
        collectives.all_to_all_single(
            out, rows.contiguous(), out_splits, in_splits, group=group, label=label
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        collectives.all_to_all_single(
            grad_in,
            grad.contiguous(),
            in_splits,
            out_splits,
            group=ctx.group,
            label=ctx.label + " backward",
        )
        return grad_in, None, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None, label: str = "moe"
) -> torch.Tensor:
    """Differentiable uneven all_to_all of (sum(in_splits), ...) rows ->
    (sum(out_splits), ...). Collective over `group`."""
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group, label)


@dataclass(frozen=True)
class ExpertParallel:
    """How a MoE layer (nbtrain.moe.MoE, MoEGPT's layers) splits its experts over the
    ranks of an ep group: given to the layer, never read from global state by it.

    Attributes:
        group: the ep process group (None: the whole world; `ALONE`: this rank alone,
            every expert local).
    """

    group: object = None

    @classmethod
    def from_topology(cls) -> "ExpertParallel | None":
        """The topology's ep group when nbtrain is initialised with ep_size > 1, else
        None. Read once, here: the caller hands the result to the layer or model."""
        if not context.is_initialized():
            return None
        topo = context.get_context().topology
        return cls(topo.group("ep")) if topo.ep_size > 1 else None


def _topology_ep():
    """The ep group of nbtrain's topology (None: the world), or False when nbtrain has
    made no context."""
    return context.get_context().topology.group("ep") if context.is_initialized() else False


def _warn_if_local_changed_meaning() -> None:
    """Until this release a layer built without a group followed the topology's ep group
    (the world without nbtrain's context): say so where that spanned more than one rank."""
    if context.is_initialized():
        old, where = context.get_context().topology.ep_size, "init_distributed(ep_size={})"
    else:
        old, where = dist.get_world_size(), "torch.distributed's world of {} ranks"
    if old > 1:
        warnings.warn(
            f"MoE built without an ep layout under {where.format(old)}: its experts "
            "are all local (no expert parallelism); before this release they were "
            "split over that group. Pass group= (MoEGPT: ep_group=) "
            "ExpertParallel.from_topology() to split them, or "
            "nbtrain.comm.topology.ALONE to keep them local without this warning",
            UserWarning,
            stacklevel=4,
        )


def _ep_group(group):
    """(group, size, rank) of a layer's `group=`: an `ExpertParallel`, a process group,
    `ALONE` or None (every expert local, whatever the topology). A one-rank group, or
    no process group at all, is ALONE."""
    if group is None:
        if dist.is_initialized():
            _warn_if_local_changed_meaning()
        return ALONE, 1, 0
    if isinstance(group, ExpertParallel):
        group = group.group  # None here: the world
    if group is ALONE or not dist.is_initialized():
        return ALONE, 1, 0
    size = dist.get_world_size(group)
    return (ALONE, 1, 0) if size == 1 else (group, size, dist.get_rank(group))


def _is_topology_ep(group) -> bool:
    """Whether `group` is the ep group of nbtrain's topology: only then are the experts
    slices that state dicts gather and `wrap` shards (over the topology's edp group).
    Experts over another group stay this rank's own (local in state dicts)."""
    topology_ep = _topology_ep()
    return topology_ep is not False and group is topology_ep
