"""Which ranks share the ZeRO shards of a parameter.

A replicated parameter (every rank of its pipeline stage holds the same tensor) is
sharded over the ranks of that stage (the "zero" group: the whole world without a
pipeline). A tensor-parallel slice differs between the tp ranks: only the ranks of
its data-parallel group hold copies of it, so its shards are spread over that group,
and its gradient is reduced there. With tp_size 1 the two coincide.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..comm.context import get_context


@dataclass(frozen=True)
class ShardGroup:
    """A process group (None: the world; `topology.ALONE`: this rank only) with this
    rank's place in it."""

    group: object
    rank: int
    size: int


def is_tp_slice(param) -> bool:
    return getattr(param, "tp_split_dim", None) is not None


def shard_group(tp_slice: bool = False) -> ShardGroup:
    """The ranks that shard a tensor-parallel slice (`tp_slice`) or a replicated tensor."""
    topo = get_context().topology
    if not tp_slice:
        return ShardGroup(topo.group("zero"), topo.zero_rank, topo.tp_size * topo.dp_size)
    return ShardGroup(topo.group("dp"), topo.dp_rank, topo.dp_size)


def copy_tp_meta(src, dst) -> None:
    """Carries a tensor-parallel slice's split dimension, part count and full shape."""
    for name in ("tp_split_dim", "tp_groups", "tp_full_shape"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
