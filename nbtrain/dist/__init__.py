"""Process setup and collectives: the only place nbtrain talks to other ranks."""
from .context import (DistContext, get_context, init_distributed, is_initialized, print_rank,
                      rank, shutdown, sum_loss, synchronize, world_size)
from .collectives import COUNTERS, CommHandle, CommKind, all_gather, all_reduce, broadcast, reduce_scatter

__all__ = ["DistContext", "get_context", "init_distributed", "is_initialized", "print_rank",
           "rank", "shutdown", "sum_loss", "synchronize", "world_size", "COUNTERS", "CommHandle",
           "CommKind", "all_gather", "all_reduce", "broadcast", "reduce_scatter"]
