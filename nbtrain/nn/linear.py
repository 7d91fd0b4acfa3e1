"""`nbtrain.nn.linear`: BMTrain's module of the same name: `Linear` (nbtrain.tensor_parallel.layers)
and its autograd function `OpLinear` (nbtrain.tensor_parallel.ops)."""

from ..tensor_parallel.layers import Linear
from ..tensor_parallel.ops import OpLinear

__all__ = ["Linear", "OpLinear"]
