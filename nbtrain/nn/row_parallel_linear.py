"""`nbtrain.nn.row_parallel_linear`: BMTrain's module of the same name:
`RowParallelLinear` (nbtrain.tensor_parallel.layers)."""

from ..tensor_parallel.layers import RowParallelLinear

__all__ = ["RowParallelLinear"]
