"""A Block's DistributedParameters as BMTrain shows them, and freezing between steps.

The parameter objects stay the user's after a Block takes their values into its flat
shards: each shows this rank's part of itself (`become_part`), and `requires_grad_` on
them or on the block's shards is honoured at the next forward (`sync_requires_grad`).
"""

from __future__ import annotations

import torch

from .flat import FlatGroup
from .parameter import DistributedParameter


def become_part(
    param: DistributedParameter, group: FlatGroup, part, offset: int, begin: int
) -> None:
    """Makes `param` show this rank's part of it in `group`'s shard: its `.data` a view
    of the shard (empty where this rank holds none of it), `.grad` the same part of the
    shard's gradient (DistributedParameter.grad), `_start_partition`/`_end_partition`
    the part's bounds in the flattened parameter (BMTrain's attributes; None and 0 for
    none)."""
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
    param._block_part = (group, span)


def sync_requires_grad(groups: list[FlatGroup], label: str) -> None:
    """Honours `requires_grad_` toggled since the last forward, on a block's shards
    (`block.parameters()`) or on the DistributedParameters it holds: the two always
    agree afterwards. A flat group trains or freezes as a whole."""
    for group in groups:
        members = [e.member for e in group.entries if e.member is not None]
        seen = group.synced_requires_grad
        if group.shard.requires_grad == seen:
            wanted = {m.requires_grad for m in members} or {seen}
            if len(wanted) > 1:
                frozen = [
                    n
                    for e in group.entries
                    if e.member is not None and not e.member.requires_grad
                    for n in e.names[:1]
                ]
                raise ValueError(
                    f"Block {label!r}: requires_grad_(False) on {frozen} but not on the "
                    "other parameters of the same flat buffer; nbtrain trains or freezes "
                    "a block's parameters of one dtype together. Toggle them all (for p "
                    "in block.parameters(): p.requires_grad_(False)), or build the block "
                    "with those parameters already frozen (they then get a buffer of "
                    "their own)."
                )
            group.shard.requires_grad_(wanted.pop())
        for m in members:
            m.requires_grad_(group.shard.requires_grad)
        group.synced_requires_grad = group.shard.requires_grad
