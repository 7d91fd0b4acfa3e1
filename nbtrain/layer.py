"""`nbtrain.layer`: BMTrain's module of the same name: `DistributedModule` (nbtrain.zero)."""

from .zero import DistributedModule

__all__ = ["DistributedModule"]
