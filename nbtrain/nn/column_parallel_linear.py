"""`nbtrain.nn.column_parallel_linear`: BMTrain's module of the same name:
`ColumnParallelLinear` (nbtrain.nn.parallel)."""

from .parallel import ColumnParallelLinear

__all__ = ["ColumnParallelLinear"]
