"""`nbtrain.block_layer`: BMTrain's module of the same name: `Block` and
`TransformerBlockList` (nbtrain.zero). Its `storage_type_cuda` (CUDA storage types)
has no counterpart: nbtrain's flat buffers are tensors on the context's device."""

from .zero import Block, TransformerBlockList

__all__ = ["Block", "TransformerBlockList"]
