"""A tensor-parallel slice and its full tensor: cutting one from the other, and back.

A slice's `Placement` (nbtrain.zero.placement) names the dimension it splits
(`split_dim`), the number of equal parts that dimension holds (`parts`: 3 for a fused
q, k, v projection, each part split on its own) and the full shape (`full_shape`). A
vocabulary that tp does not divide is padded with zero rows before it is cut; the
padding is dropped again when the full tensor is put back together. Used by the
tensor-parallel layers' state dicts and by Blocks holding slices.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.accounting import CommKind
from ..comm.context import get_context


def _axis(placed) -> tuple[int, int, object]:
    """(size, rank, group) of the ranks a slice is cut over: the tp group, or the ep
    group for experts."""
    topo = get_context().topology
    if placed.slice_group == "ep":
        return topo.ep_size, topo.ep_rank, topo.group("ep")
    return topo.tp_size, topo.tp_rank, topo.group("tp")


def pad_along(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `length` (a padded vocabulary)."""
    pad = length - t.shape[dim]
    if pad <= 0:
        return t
    return torch.cat([t, t.new_zeros(*t.shape[:dim], pad, *t.shape[dim + 1 :])], dim=dim)


def cut(full: torch.Tensor, dim: int | None, size: int, rank: int, groups: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim` (None: all of it). With `groups` > 1
    the dimension is that many equal parts and each part is split."""
    if dim is None:
        return full
    parts = full.chunk(groups, dim=dim)
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim)


def full_from_slice(local: torch.Tensor, placed) -> torch.Tensor:
    """The full logical tensor from every tp rank's `local` slice of a parameter placed
    as `placed` (its Placement; collective over tp, or ep for experts). Vocabulary
    padding is dropped."""
    dim, groups = placed.split_dim, placed.parts
    size, _, group = _axis(placed)
    moved = local.detach().movedim(dim, -1).contiguous()
    if size > 1:
        stacked = torch.empty((size, *moved.shape), dtype=moved.dtype, device=moved.device)
        C.all_gather(
            stacked.view(-1),
            moved.view(-1),
            group=group,
            label="tp gather state",
            kind=CommKind.TP_ALL_GATHER,
        )
        moved = torch.cat(stacked.unbind(0), dim=-1)
    if groups > 1:  # [rank][part][rows] -> [part][rank][rows]
        lead = moved.shape[:-1]
        moved = moved.reshape(*lead, size, groups, -1).transpose(-3, -2).reshape(*lead, -1)
    full = moved.movedim(-1, dim)
    return full.narrow(dim, 0, placed.full_shape[dim]).clone()


def slice_from_full(value: torch.Tensor, placed, local_shape) -> torch.Tensor | None:
    """This rank's slice of the full tensor `value` (returned as is when it already has
    `local_shape`), or None when `value` has neither shape."""
    if tuple(value.shape) == tuple(local_shape):
        return value
    if tuple(value.shape) != tuple(placed.full_shape):
        return None
    size, rank, _ = _axis(placed)
    dim, groups = placed.split_dim, placed.parts
    value = pad_along(value, dim, local_shape[dim] * size)  # a padded vocabulary
    return cut(value, dim, size, rank, groups).contiguous().clone()
