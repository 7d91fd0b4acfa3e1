"""`nbtrain.nn.column_parallel_linear`: BMTrain's module of the same name:
`ColumnParallelLinear` (nbtrain.tensor_parallel.layers)."""

from ..tensor_parallel.layers import ColumnParallelLinear

__all__ = ["ColumnParallelLinear"]
