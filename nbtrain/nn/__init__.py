"""Layers and losses under BMTrain's `bmt.nn` / `bmt.loss` names.

Tensor-parallel layers (`ColumnParallelLinear`, `RowParallelLinear`, `VPEmbedding`)
split their weights over the tp ranks of `init_distributed(tp_size=...)`; see
nbtrain.nn.parallel for the layouts each flag gives. BMTrain's autograd functions
`OpLinear` and `OpParallelLinear` (with its `ReduceType`) are in nbtrain.nn.ops.

Context parallelism: `ring_attention(q, k, v, causal=True, group=cp_group)` is exact
attention over a sequence split across the ranks of a cp group, with `shard_sequence`,
`gather_sequence` and `document_ids`, from their home nbtrain.context_parallel.
"""

from ..context_parallel import (
    SequenceLayout,
    document_ids,
    gather_sequence,
    ring_attention,
    shard_sequence,
)
from .loss import FusedCrossEntropy, parallel_cross_entropy
from .ops import OpLinear, OpParallelLinear, ReduceType
from .parallel import (
    ColumnParallelLinear,
    LayerNorm,
    Linear,
    RowParallelLinear,
    VPEmbedding,
)

__all__ = [
    "ColumnParallelLinear",
    "FusedCrossEntropy",
    "LayerNorm",
    "Linear",
    "OpLinear",
    "OpParallelLinear",
    "ReduceType",
    "RowParallelLinear",
    "SequenceLayout",
    "VPEmbedding",
    "document_ids",
    "gather_sequence",
    "parallel_cross_entropy",
    "ring_attention",
    "shard_sequence",
]
