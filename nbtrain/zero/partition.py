"""Partition maths for flat sharded storage. Pure functions, no torch.distributed.

A flat buffer holds several parameters back to back. Its numel is padded up to a
multiple of the world size so every rank owns one equal, contiguous slice:
rank r owns [r * shard_numel, (r + 1) * shard_numel). A parameter may lie wholly
in one rank's slice, straddle several, or (for small ones) be absent from a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of `world_size` that is >= numel (at least world_size)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return max(1, math.ceil(numel / world_size)) * world_size


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank stores: ceil(numel / world_size) (at least 1)."""
    return padded_numel(numel, world_size) // world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[begin, end) of `rank`'s slice in the padded flat buffer."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside world of size {world_size}")
    n = shard_numel(numel, world_size)
    return rank * n, (rank + 1) * n


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in a flat buffer."""

    name: str
    shape: tuple
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def local_part(self, begin: int, end: int) -> tuple[int, int] | None:
        """Intersection with the shard [begin, end) as (start, stop) in flat
        coordinates, or None when this rank holds none of the parameter."""
        lo, hi = max(self.offset, begin), min(self.end, end)
        return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class FlatLayout:
    """Parameters laid out back to back, padded for `world_size` ranks."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple]], world_size: int) -> "FlatLayout":
        slots, offset = [], 0
        for name, shape in named_shapes:
            numel = math.prod(shape)
            slots.append(ParamSlot(name, tuple(shape), offset, numel))
            offset += numel
        return cls(tuple(slots), world_size)

    @property
    def numel(self) -> int:
        """Elements of real data (no padding)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.numel, self.world_size, rank)
