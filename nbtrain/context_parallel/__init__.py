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
"""

from .kernels import uses_fused_kernel
from .layout import (
    Block,
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
    "Block",
    "ContextParallel",
    "Ring",
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
