"""`nbtrain.lr_scheduler` (BMTrain's module name): the schedules live in
nbtrain.optim.lr_scheduler; these are the same classes."""

from .optim.lr_scheduler import (
    Cosine,
    Exponential,
    Linear,
    Noam,
    NoDecay,
    WarmupLRScheduler,
)

__all__ = ["Cosine", "Exponential", "Linear", "NoDecay", "Noam", "WarmupLRScheduler"]
