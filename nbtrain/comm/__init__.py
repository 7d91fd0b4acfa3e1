"""The comm layer: process setup, collectives, and the events they publish.

The only place nbtrain talks to other ranks. It imports nothing else of nbtrain."""

from .collectives import (
    COUNTERS,
    CommHandle,
    CommKind,
    all_gather,
    all_reduce,
    broadcast,
    reduce_scatter,
)
from .context import (
    DistContext,
    get_context,
    init_distributed,
    is_initialized,
    print_rank,
    rank,
    shutdown,
    synchronize,
    world_size,
)
from .hang_report import CollectiveError

__all__ = [
    "DistContext",
    "get_context",
    "init_distributed",
    "is_initialized",
    "print_rank",
    "rank",
    "shutdown",
    "synchronize",
    "world_size",
    "COUNTERS",
    "CommHandle",
    "CommKind",
    "CollectiveError",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce_scatter",
]
