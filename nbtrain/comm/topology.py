"""Where each rank sits: pipeline stage, data-parallel replica, tensor-parallel slot.

Ranks are laid out pipeline outermost, then data, then tensor innermost (BMTrain's
and torchtitan's order), so tensor-parallel peers are neighbours (one host, fast
links):

    rank = (pipe_rank * dp_size + dp_rank) * tp_size + tp_rank

The named groups, each the ranks that share every coordinate but one:

    tp     same stage and replica: split one layer's tensors       (size tp_size)
    dp     same stage and tp slot: hold the same slice, reduce its gradients
           (BMTrain's "tp_zero" group)                             (size dp_size)
    zero   same stage: every rank holding a part of the stage's parameters
                                                                   (size dp x tp)
    pipe   same replica and tp slot: the stages of one pipeline    (size pipe_size)

Expert and context parallelism are carved from the data-parallel ranks (each size
divides dp_size); within a dp group, ep_rank = dp_rank % ep_size and cp_rank =
dp_rank % cp_size, so their peers are neighbours too:

    ep     dp ranks with the same dp_rank // ep_size: together hold every expert,
           exchange tokens by all-to-all                           (size ep_size)
    edp    dp ranks with the same ep_rank: hold the same experts, shard and reduce
           their gradients                                         (size dp / ep)
    cp     dp ranks with the same dp_rank // cp_size: split one sequence (ring
           attention); they read the same batch, each its part      (size cp_size)

Every replicated parameter stays sharded and reduced over dp (cp ranks are data-
parallel ranks whose data is a part of a sequence). Distinct batches: dp / cp
(`data_size`, this rank's `data_rank`).

A group that spans the whole world is None (torch's default group) and a group of
one rank is `ALONE` (nothing to communicate: callers skip the collective), so a
plain data-parallel run makes no extra groups and behaves as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .layout import Layout
from .topology_names import BMTrainTopologyNames

GROUPS = ("tp", "dp", "zero", "pipe", "ep", "edp", "cp")


class _Alone:
    """The group of a kind that has one rank: collectives over it are no-ops."""

    def __repr__(self) -> str:
        return "ALONE"


ALONE = _Alone()


def check_sizes(
    world_size: int, tp_size: int, pipe_size: int, ep_size: int = 1, cp_size: int = 1
) -> int:
    """The data-parallel size, or a ValueError naming the numbers that do not fit
    (the rule is `layout.Layout.check`'s)."""
    return Layout(tp_size, pipe_size, ep_size, cp_size).check(world_size)


def coordinates(rank: int, tp_size: int, dp_size: int) -> tuple[int, int, int]:
    """(pipe_rank, dp_rank, tp_rank) of a global rank."""
    return rank // (tp_size * dp_size), (rank // tp_size) % dp_size, rank % tp_size


def group_ranks(
    name: str, world_size: int, tp_size: int, pipe_size: int, ep_size: int = 1, cp_size: int = 1
) -> list[list[int]]:
    """Every group of kind `name`, as sorted rank lists, in a fixed order."""
    dp_size = world_size // (tp_size * pipe_size)
    stage = tp_size * dp_size

    def rank_of(p, d, t):
        return (p * dp_size + d) * tp_size + t

    if name == "tp":
        return [
            [rank_of(p, d, t) for t in range(tp_size)]
            for p in range(pipe_size)
            for d in range(dp_size)
        ]
    if name == "dp":
        return [
            [rank_of(p, d, t) for d in range(dp_size)]
            for p in range(pipe_size)
            for t in range(tp_size)
        ]
    if name == "zero":
        return [list(range(p * stage, (p + 1) * stage)) for p in range(pipe_size)]
    if name == "pipe":
        return [
            [rank_of(p, d, t) for p in range(pipe_size)]
            for d in range(dp_size)
            for t in range(tp_size)
        ]
    if name in ("ep", "cp"):  # consecutive dp ranks
        size = ep_size if name == "ep" else cp_size
        return [
            [rank_of(p, q * size + i, t) for i in range(size)]
            for p in range(pipe_size)
            for t in range(tp_size)
            for q in range(dp_size // size)
        ]
    if name == "edp":  # dp ranks with the same ep_rank
        return [
            [rank_of(p, q * ep_size + e, t) for q in range(dp_size // ep_size)]
            for p in range(pipe_size)
            for t in range(tp_size)
            for e in range(ep_size)
        ]
    raise ValueError(f"unknown group {name!r}; known: {', '.join(GROUPS)}")


@dataclass(frozen=True)
class Topology(BMTrainTopologyNames):
    """This rank's coordinates and the process group of each kind it belongs to."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pipe_size: int = 1
    ep_size: int = 1
    cp_size: int = 1
    groups: dict = field(default_factory=dict, compare=False, repr=False)
    members: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tp_rank(self) -> int:
        return coordinates(self.rank, self.tp_size, self.dp_size)[2]

    @property
    def dp_rank(self) -> int:
        return coordinates(self.rank, self.tp_size, self.dp_size)[1]

    @property
    def pipe_rank(self) -> int:
        return coordinates(self.rank, self.tp_size, self.dp_size)[0]

    @property
    def ep_rank(self) -> int:
        """Which experts this rank holds: its place in the ep group."""
        return self.dp_rank % self.ep_size

    @property
    def edp_rank(self) -> int:
        """Its place among the ranks holding the same experts (the edp group)."""
        return self.dp_rank // self.ep_size

    @property
    def cp_rank(self) -> int:
        """Which part of each sequence this rank holds: its place in the cp group."""
        return self.dp_rank % self.cp_size

    @property
    def data_size(self) -> int:
        """Distinct batches per step: the data-parallel ranks over the cp size."""
        return self.dp_size // self.cp_size

    @property
    def data_rank(self) -> int:
        """Which batch this rank reads (its cp peers read the same one)."""
        return self.dp_rank // self.cp_size

    @property
    def zero_rank(self) -> int:
        """Rank within this pipeline stage (BMTrain's zero_rank)."""
        return self.rank % (self.tp_size * self.dp_size)

    def group(self, name: str):
        """The process group of kind `name` holding this rank (None: the whole world;
        ALONE: this rank only)."""
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; known: {', '.join(GROUPS)}")
        return self.groups.get(name)

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group of kind `name`."""
        if name not in self.members:
            return [
                r
                for ranks in group_ranks(
                    name, self.world_size, self.tp_size, self.pipe_size, self.ep_size, self.cp_size
                )
                if self.rank in ranks
                for r in ranks
            ]
        return list(self.members[name])

    def label(self) -> str:
        """'rank 3 tp1 dp1' style, with only the coordinates that are split."""
        parts = [f"rank {self.rank}"]
        if self.pipe_size > 1:
            parts.append(f"pp{self.pipe_rank}")
        if self.tp_size > 1:
            parts.append(f"tp{self.tp_rank}")
        if self.tp_size > 1 or self.pipe_size > 1:
            parts.append(f"dp{self.dp_rank}")
        if self.ep_size > 1:
            parts.append(f"ep{self.ep_rank}")
        if self.cp_size > 1:
            parts.append(f"cp{self.cp_rank}")
        return " ".join(parts)


def build(
    rank: int,
    world_size: int,
    tp_size: int = 1,
    pipe_size: int = 1,
    ep_size: int = 1,
    cp_size: int = 1,
) -> Topology:
    """Make the groups of every kind (collective: every rank calls it, same arguments).

    Groups the size of the world are None (the default group); every other group is
    created on every rank in the same order, as torch.distributed requires. A kind
    whose groups equal an earlier kind's (edp is dp when ep_size is 1) shares them.
    """
    dp_size = check_sizes(world_size, tp_size, pipe_size, ep_size, cp_size)
    groups, members, made_for = {}, {}, {}
    for name in GROUPS:
        all_ranks = group_ranks(name, world_size, tp_size, pipe_size, ep_size, cp_size)
        mine = next(ranks for ranks in all_ranks if rank in ranks)
        members[name] = tuple(mine)
        if len(mine) == world_size:
            groups[name] = None
            continue
        if len(mine) == 1:
            groups[name] = ALONE
            continue
        key = tuple(map(tuple, all_ranks))
        if key not in made_for:
            made = None
            for ranks in all_ranks:  # every rank creates every group, in one order
                group = dist.new_group(ranks)
                if rank in ranks:
                    made = group
            made_for[key] = made
        groups[name] = made_for[key]
    return Topology(
        rank=rank,
        world_size=world_size,
        tp_size=tp_size,
        dp_size=dp_size,
        pipe_size=pipe_size,
        ep_size=ep_size,
        cp_size=cp_size,
        groups=groups,
        members=members,
    )
