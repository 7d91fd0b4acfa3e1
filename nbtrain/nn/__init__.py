"""Layers and losses under BMTrain's `bmt.nn` / `bmt.loss` names.

Tensor-parallel layers (`ColumnParallelLinear`, `RowParallelLinear`, `VPEmbedding`)
split their weights over the tp ranks of `init_distributed(tp_size=...)`; see
nbtrain.nn.parallel for the layouts each flag gives.
"""
from .loss import FusedCrossEntropy, parallel_cross_entropy
from .parallel import (ColumnParallelLinear, LayerNorm, Linear, RowParallelLinear,
                       VPEmbedding)

__all__ = ["ColumnParallelLinear", "FusedCrossEntropy", "LayerNorm", "Linear", "RowParallelLinear",
           "VPEmbedding", "parallel_cross_entropy"]
