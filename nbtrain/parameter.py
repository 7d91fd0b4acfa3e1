"""`nbtrain.parameter`: BMTrain's module of the same name: `DistributedParameter` and
`ParameterInitializer` (nbtrain.zero.parameter). Its `OpAllGather` (the autograd
function behind gathering a parameter) is internal there and here."""

from .zero import DistributedParameter, ParameterInitializer

__all__ = ["DistributedParameter", "ParameterInitializer"]
