"""Layers and losses under BMTrain's `bmt.nn` / `bmt.loss` names.

Tensor-parallel layers (`ColumnParallelLinear`, `RowParallelLinear`, `VPEmbedding`)
split their weights over the tp ranks of `init_distributed(tp_size=...)`; see
nbtrain.tensor_parallel.layers for the layouts each flag gives. BMTrain's autograd functions
`OpLinear` and `OpParallelLinear` (with its `ReduceType`) are in nbtrain.tensor_parallel.ops.

Context parallelism (`ring_attention`, `shard_sequence`, `gather_sequence`,
`document_ids`, `SequenceLayout`) lives in nbtrain.context_parallel; the names here are
deprecated aliases that warn and go in the next release.
"""

import warnings

from .. import context_parallel as _context_parallel
from ..tensor_parallel.layers import (
    ColumnParallelLinear,
    LayerNorm,
    Linear,
    RowParallelLinear,
    VPEmbedding,
)
from ..tensor_parallel.ops import OpLinear, OpParallelLinear, ReduceType
from .loss import FusedCrossEntropy, parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "FusedCrossEntropy",
    "LayerNorm",
    "Linear",
    "OpLinear",
    "OpParallelLinear",
    "ReduceType",
    "RowParallelLinear",
    "VPEmbedding",
    "parallel_cross_entropy",
]

_MOVED = ("SequenceLayout", "document_ids", "gather_sequence", "ring_attention", "shard_sequence")


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(
            f"nbtrain.nn.{name} moved: import it from nbtrain.context_parallel "
            "(this alias goes in the next release)",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(_context_parallel, name)
    raise AttributeError(f"module 'nbtrain.nn' has no attribute {name!r}")
