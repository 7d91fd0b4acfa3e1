"""Optimizers over local shards, and the manager that scales, checks and clips.

`AdamOptimizer` and `AdamOffloadOptimizer` update this rank's shards (fp32 master
weights for bf16/fp16 parameters); `OptimManager` adds loss scaling with a
cross-rank overflow check, gradient clipping over all ranks, accumulation and
learning-rate schedules.
"""

from .adam import AdamOptimizer, adam_update
from .adam_offload import AdamOffloadOptimizer
from .manager import OptimManager

__all__ = ["AdamOptimizer", "AdamOffloadOptimizer", "OptimManager", "adam_update"]
