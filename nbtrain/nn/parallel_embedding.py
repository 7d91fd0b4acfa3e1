"""`nbtrain.nn.parallel_embedding`: BMTrain's module of the same name:
`VPEmbedding` (nbtrain.nn.parallel)."""

from .parallel import VPEmbedding

__all__ = ["VPEmbedding"]
