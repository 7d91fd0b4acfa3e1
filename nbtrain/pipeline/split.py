"""Which layers each pipeline stage owns: contiguous runs, balanced by parameter count.

A stage names its layers by their index in the whole model, so its state_dict and
named_parameters are those of the plain `nn.Sequential(*layers)` ("3.0.weight" on
whichever stage holds layer 3), and a sharded checkpoint (`nbtrain.save_checkpoint`)
written at one pipeline layout loads at another (pp=2 -> pp=1 with dp=2, the
reverse, ZeRO inside stages), model and optimizer state. A tied parameter is stored
once, under its first plain name, and restored on every stage holding it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..comm import topology as _topology
from ..comm.context import get_context
from ..zero import place


def balanced_split(sizes: list[int], stages: int) -> list[range]:
    """Contiguous ranges of `sizes` (one weight per layer), one per stage, every stage at
    least one layer, the heaviest stage as light as it can be (a binary search on it)."""
    if not 1 <= stages <= len(sizes):
        raise ValueError(
            f"{len(sizes)} layers cannot fill {stages} pipeline stages: use "
            f"pipe_size <= {len(sizes)}"
        )

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
        parts[i : i + 1] = [range(r.start, half), range(half, r.stop)]
    return parts


class Stage(nn.Module):
    """One pipeline stage's layers, run in order, under the plain model's names.

    Args:
        layers: this stage's layers, in order.
        positions: their indices in the whole model (default 0, 1, ...): layer k is
            registered as `str(positions[k])`, so `state_dict()` and `named_parameters()`
            give the names of the plain `nn.Sequential(*all_layers)` ("3.0.weight"), the
            same at every pipeline layout. `stage.layers` lists the layers in order.

    `nbtrain.wrap(stage)` (or a Stage that is a DistributedModule's) shards and reduces
    them over this stage's ranks only: each layer becomes a Block in place, and any other
    parameter (a layer sharing a parameter with another layer, or with another stage) is
    sharded over the stage.

    Attributes:
        ties: (parameter, process group) for each parameter this stage shares with other
            stages (a tied embedding): `pipeline.run` sums its gradient over the group.
            Kept by name and looked up on each read, so after `nbtrain.wrap` it names the
            DistributedParameter that is trained, not the plain one it replaced.
        tied_names: this stage's name of a parameter shared with an earlier stage -> the
            plain model's first name for it (the one a checkpoint stores it under).
    """

    def __init__(self, layers, positions=None):
        super().__init__()
        layers = list(layers)
        positions = list(range(len(layers))) if positions is None else [int(i) for i in positions]
        if len(positions) != len(layers) or len(set(positions)) != len(positions):
            raise ValueError(
                f"Stage: positions {positions} must give {len(layers)} distinct "
                "indices, one per layer"
            )
        self.positions = positions
        for i, layer in zip(positions, layers):
            self.add_module(str(i), layer)
        place(self, stage=True)  # its parameters shard over the stage's ranks
        self._tie_names: list[tuple[str, object, int]] = []  # (name here, group, key)
        self.tied_names: dict[str, str] = {}

    @property
    def ties(self) -> list[tuple[nn.Parameter, object]]:
        """(parameter, process group of the ranks sharing it), the parameters as they
        are now (DistributedParameters once `nbtrain.wrap` has sharded them)."""
        return [(p, group) for _, p, group in self.tie_keys]

    @ties.setter
    def ties(self, pairs) -> None:
        self.set_ties([(k, p, group) for k, (p, group) in enumerate(pairs)])

    @property
    def tie_keys(self) -> list[tuple[int, nn.Parameter, object]]:
        """(key, parameter, group): the key names the logical parameter, the same on
        every rank and chunk holding it (chunks wrapped one by one hold copies)."""
        return [(key, _parameter_at(self, name), group) for name, group, key in self._tie_names]

    def set_ties(self, ties) -> None:
        """Records (key, parameter, group) triples by this stage's name of each parameter;
        keys must rise in the same order on every rank (`run` sums in key order)."""
        names = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        missing = [tuple(p.shape) for _, p, _ in ties if id(p) not in names]
        if missing:
            raise ValueError(
                f"Stage.ties: parameters of shapes {missing} are not in this "
                "stage; list only parameters its layers hold"
            )
        self._tie_names = [(names[id(p)], group, key) for key, p, group in ties]

    @property
    def layer_keys(self) -> list[str]:
        """The layers' names in this module, in order."""
        return [str(i) for i in self.positions]

    @property
    def layers(self) -> list[nn.Module]:
        """The layers in order (Blocks once `nbtrain.wrap` has sharded them)."""
        return [self._modules[k] for k in self.layer_keys]

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stage_of(layers, split: list[range] | None = None) -> Stage:
    """This rank's stage: its contiguous run of `layers` (balanced by parameter count
    unless `split`, one range per stage, is given), named as in `nn.Sequential(*layers)`.

    A parameter used by layers of several stages (a tied embedding and output
    projection) stays one logical parameter: `pipeline.run` sums its gradients over
    the stages holding it, and a checkpoint stores it once, under its first name in
    the plain model, and restores it on every stage holding it.

    Collective: every rank calls this with the same layers (the tie groups).
    """
    layers = list(layers)
    topo = get_context().topology
    if split is None:
        split = balanced_split(
            [max(1, sum(p.numel() for p in m.parameters())) for m in layers], topo.pipe_size
        )
    if len(split) != topo.pipe_size:
        raise ValueError(f"split has {len(split)} ranges for pipe_size {topo.pipe_size}")
    mine = split[topo.pipe_rank]
    stage = Stage([layers[i] for i in mine], positions=mine)
    stage.set_ties(_tie_groups(layers, split))
    stage.tied_names = _tied_names(layers, mine)
    return stage


def _parameter_at(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter registered as `name` (read from `_parameters`, so a forward's
    gathered stand-in for a DistributedParameter is never returned)."""
    owner, _, leaf = name.rpartition(".")
    param = module.get_submodule(owner)._parameters.get(leaf)
    if param is None:
        raise ValueError(
            f"the tied parameter {name!r} is no longer a parameter of its "
            "module (a Block took it?): keep layers holding a parameter shared "
            "with another stage out of Blocks; nbtrain.wrap(stage) does"
        )
    return param


def _tied_names(layers: list, mine: range) -> dict[str, str]:
    """This stage's names of parameters an earlier layer also uses -> the first name
    `nn.Sequential(*layers).named_parameters()` gives them."""
    first: dict[int, str] = {}
    out = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            plain = f"{i}.{name}"
            if id(p) not in first:
                first[id(p)] = plain
            elif i in mine and first[id(p)] != plain:
                out[plain] = first[id(p)]
    return out


def _tie_groups(layers: list, split: list) -> list[tuple[int, nn.Parameter, object]]:
    """Parameters used by layers of several stages (a tied embedding and output
    projection), as (key, parameter, process group): one group per pipeline over the
    stages holding each, for `run` to sum their gradients; the key is the parameter's
    place among the distinct parameters of `layers`, the same on every rank.
    Collective: every rank makes every group."""
    keys = param_keys(layers)
    owners: dict[int, tuple] = {}
    for s, part in enumerate(split):
        for i in part:
            for p in layers[i].parameters():
                owners.setdefault(id(p), (keys[id(p)], p, set()))[2].add(s)
    ctx = get_context()
    topo = ctx.topology
    ties = []
    for key, p, stages in owners.values():
        if len(stages) < 2:
            continue
        for pipeline in _topology.group_ranks("pipe", ctx.world_size, topo.tp_size, topo.pipe_size):
            members = [pipeline[s] for s in sorted(stages)]
            group = dist.new_group(members)
            if ctx.rank in members:
                ties.append((key, p, group))
    return ties


def param_keys(layers: list) -> dict[int, int]:
    """id(parameter) -> its place among the distinct parameters of `layers`."""
    keys: dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():
            keys.setdefault(id(p), len(keys))
    return keys
