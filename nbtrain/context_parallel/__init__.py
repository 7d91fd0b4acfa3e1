"""Context parallelism: each rank of a cp group holds a shard of every sequence.

Read in this order:
    layout.py   which tokens a rank holds (zigzag or contiguous chunks), sharding and
                gathering sequences, packed documents' ids, the blocks a ring step computes
    kernels.py  a block's attention: a fused torch op where it exists and agrees with the
                float32 math (checked once), else the math
    ring.py     `ring_attention` and its autograd function: K/V around the ring, each
                exchange through nbtrain.comm.collectives, hidden behind a block's compute
    model.py    `ContextParallel`: the layout a model takes as an argument

`ring_attention(q, k, v, causal=True, group=cp_group)` is exact attention over the
sharded sequence; a model under context parallelism is given a `ContextParallel`
(`ContextParallel.from_topology()` for the cp group of `init_distributed(cp_size=...)`).

Import ring attention from here, its one documented path: `nbtrain.nn.ring` and
`nbtrain.nn.ring_attention` are deprecated re-exports (docs/naming.md). `RingBlock` is a
ring step's tile of attention (`context_parallel.Block` is its deprecated old name).
"""

from .kernels import uses_fused_kernel
from .layout import (
    RingBlock,
    SequenceLayout,
    check_position_ids,
    chunk_ids,
    document_ids,
    gather_sequence,
    global_positions,
    shard_sequence,
)
from .model import ContextParallel
from .ring import Ring, ring_attention

__all__ = [
    "ContextParallel",
    "Ring",
    "RingBlock",
    "SequenceLayout",
    "check_position_ids",
    "chunk_ids",
    "document_ids",
    "gather_sequence",
    "global_positions",
    "ring_attention",
    "shard_sequence",
    "uses_fused_kernel",
]


_RENAMED = {"Block": "RingBlock"}  # old name -> new name, for one release


def __getattr__(name):
    # `Block` collided with `nbtrain.Block` (ZeRO's): the old name still works, warning.
    if name in _RENAMED:
        from ..comm.renamed import warn_renamed

        new = _RENAMED[name]
        warn_renamed(f"nbtrain.context_parallel.{name}", f"nbtrain.context_parallel.{new}")
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
