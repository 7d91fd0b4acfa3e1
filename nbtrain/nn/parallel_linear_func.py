"""`nbtrain.nn.parallel_linear_func`: BMTrain's module of the same name: `OpParallelLinear`
and `ReduceType` (nbtrain.tensor_parallel.ops). Its helpers (preprocess_input and the async
all-gather / reduce-scatter linear functions) are the steps inside OpParallelLinear,
which nbtrain.tensor_parallel.comm does its own way."""

from ..tensor_parallel.ops import OpParallelLinear, ReduceType

__all__ = ["OpParallelLinear", "ReduceType"]
