"""A Block's DistributedParameters as BMTrain shows them, and freezing between steps.

The parameter objects stay the user's after a Block takes their values into its flat
shards: each shows this rank's part of itself (`become_part`), and `requires_grad_` on
one of them, or on a block's shard, is honoured at the next forward (`sync_requires_grad`).
"""

from __future__ import annotations

import torch

from .flat import FlatGroup
from .freeze import guard_optimizer_steps
from .parameter import DistributedParameter


def become_part(
    param: DistributedParameter, group: FlatGroup, part, offset: int, begin: int, slot: int
) -> None:
    """Makes `param` show this rank's part of it in `group`'s shard: its `.data` a view
    of the shard (empty where this rank holds none of it), `.grad` the same part of the
    shard's gradient (DistributedParameter.grad), `_start_partition`/`_end_partition`
    the part's bounds in the flattened parameter (BMTrain's attributes; None and 0 for
    none). `slot`: the parameter's index in the group's layout."""
    with torch.no_grad():
        if part is None:
            param.data = group.shard.detach()[:0]
            param._start_partition, param._end_partition = None, 0
            span = None
        else:
            lo, hi = part
            param.data = group.shard.detach()[lo - begin : hi - begin]
            param._start_partition, param._end_partition = lo - offset, hi - offset
            span = (lo - begin, hi - begin)
    param.requires_grad_(group.shard.requires_grad)
    param._in_block = True
    param._block_part = (group, span, slot)


def sync_requires_grad(groups: list[FlatGroup], label: str) -> None:
    """Honours `requires_grad_` toggled since the last forward, on a block's shards
    (`block.parameters()`: every parameter of that flat buffer follows) or on one
    parameter the block holds (a DistributedParameter, or the placeholder a plain
    parameter shows outside forward): that parameter alone trains or freezes
    (freeze.py). Sets each group's `trainable` flags; a shard requires grad while
    any of its parameters does. Local: every rank must toggle the same parameters."""
    for group in groups:
        toggled = group.shard.requires_grad != group.synced_requires_grad
        flags = []
        for entry in group.entries:
            holder = entry.member if entry.member is not None else entry.rest
            if toggled and holder.requires_grad != group.shard.requires_grad:
                holder.requires_grad_(group.shard.requires_grad)
            flags.append(holder.requires_grad)
        group.trainable = flags
        group.shard.requires_grad_(any(flags))
        group.synced_requires_grad = group.shard.requires_grad
        if any(flags) and not all(flags):
            guard_optimizer_steps()
