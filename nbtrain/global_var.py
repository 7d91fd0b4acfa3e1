"""`nbtrain.global_var`: BMTrain's module of the same name.

`config` is `nbtrain.config` itself (a read-only view of the context made by
`init_distributed`, nbtrain/comm/config.py); `rank()` and `world_size()` are
`nbtrain.rank` and `nbtrain.world_size`. BMTrain's config is a mutable dict that
answers rank 0 of 1 before initialisation; these raise a RuntimeError then.
"""

from .comm.config import Config as ConfigMap  # BMTrain's name for config's type
from .comm.config import config
from .comm.context import rank, world_size

__all__ = ["ConfigMap", "config", "rank", "world_size"]
