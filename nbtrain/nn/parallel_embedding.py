"""`nbtrain.nn.parallel_embedding`: BMTrain's module of the same name:
`VPEmbedding` (nbtrain.tensor_parallel.layers)."""

from ..tensor_parallel.layers import VPEmbedding

__all__ = ["VPEmbedding"]
