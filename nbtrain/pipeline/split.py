"""Which layers each pipeline stage owns: contiguous runs, balanced by parameter count."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..comm import topology as _topology
from ..comm.context import get_context


def balanced_split(sizes: list[int], stages: int) -> list[range]:
    """Contiguous ranges of `sizes` (one weight per layer), one per stage, every stage at
    least one layer, the heaviest stage as light as it can be (a binary search on it)."""
    if not 1 <= stages <= len(sizes):
        raise ValueError(f"{len(sizes)} layers cannot fill {stages} pipeline stages: use "
                         f"pipe_size <= {len(sizes)}")

    def cuts(limit):
        out, start, load = [], 0, 0
        for i, size in enumerate(sizes):
            if load + size > limit and i > start:
                out.append(range(start, i))
                start, load = i, 0
            load += size
        out.append(range(start, len(sizes)))
        return out

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(cuts(mid)) <= stages:
            hi = mid
        else:
            lo = mid + 1
    parts = cuts(lo)
    while len(parts) < stages:  # fewer heavy stages than asked: split the longest run
        i = max(range(len(parts)), key=lambda k: len(parts[k]))
        r = parts[i]
        half = r.start + len(r) // 2
        parts[i:i + 1] = [range(r.start, half), range(half, r.stop)]
    return parts


class Stage(nn.Module):
    """One pipeline stage's layers, run in order. `nbtrain.wrap(stage)` (or a Stage that
    is a DistributedModule's) shards and reduces them over this stage's ranks only:
    each layer becomes a Block, and any other parameter is sharded over the stage."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._nbtrain_pipeline_stage = True
        self.ties: list = []  # (parameter, process group of the stages sharing it)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stage_of(layers, split: list[range] | None = None) -> Stage:
    """This rank's stage: its contiguous run of `layers` (balanced by parameter count
    unless `split`, one range per stage, is given)."""
    layers = list(layers)
    topo = get_context().topology
    if split is None:
        split = balanced_split([max(1, sum(p.numel() for p in m.parameters()))
                                for m in layers], topo.pipe_size)
    if len(split) != topo.pipe_size:
        raise ValueError(f"split has {len(split)} ranges for pipe_size {topo.pipe_size}")
    stage = Stage([layers[i] for i in split[topo.pipe_rank]])
    stage.ties = _tie_groups(layers, split)
    return stage


def _tie_groups(layers: list, split: list[range]) -> list:
    """Parameters used by layers of several stages (a tied embedding and output
    projection): one process group per pipeline over the stages holding each, for
    `run` to sum their gradients. Collective: every rank makes every group."""
    owners: dict[int, tuple] = {}
    for s, part in enumerate(split):
        for i in part:
            for p in layers[i].parameters():
                owners.setdefault(id(p), (p, set()))[1].add(s)
    ctx = get_context()
    topo = ctx.topology
    ties = []
    for p, stages in owners.values():
        if len(stages) < 2:
            continue
        for pipeline in _topology.group_ranks("pipe", ctx.world_size, topo.tp_size,
                                              topo.pipe_size):
            members = [pipeline[s] for s in sorted(stages)]
            group = dist.new_group(members)
            if ctx.rank in members:
                ties.append((p, group))
    return ties
