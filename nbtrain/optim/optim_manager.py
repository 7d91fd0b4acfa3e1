"""`nbtrain.optim.optim_manager` (BMTrain's module path): OptimManager lives in
nbtrain.optim.manager; `from nbtrain.optim.optim_manager import OptimManager` gives
that same class."""

from .manager import OptimManager

__all__ = ["OptimManager"]
