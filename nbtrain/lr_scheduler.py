"""`nbtrain.lr_scheduler` (BMTrain's module name): the schedules live in nbtrain.optim."""
from .optim.lr_scheduler import *  # noqa: F401,F403
from .optim.lr_scheduler import __all__  # noqa: F401
