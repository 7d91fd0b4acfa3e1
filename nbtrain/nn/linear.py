"""`nbtrain.nn.linear`: BMTrain's module of the same name: `Linear` (nbtrain.nn.parallel)
and its autograd function `OpLinear` (nbtrain.nn.ops)."""

from .ops import OpLinear
from .parallel import Linear

__all__ = ["Linear", "OpLinear"]
