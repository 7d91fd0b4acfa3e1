"""`nbtrain.nn.row_parallel_linear`: BMTrain's module of the same name:
`RowParallelLinear` (nbtrain.nn.parallel)."""

from .parallel import RowParallelLinear

__all__ = ["RowParallelLinear"]
