"""What a parameter is (its `Placement` record) and which ranks share its ZeRO shards.

Every parameter nbtrain places carries one record, set where it is placed (a tp layer
cuts a slice, an MoE layer its experts, a pipeline its stages, a Block its flat shard)
and read through `placement_of`: the gradient norm, the checkpoints, the planner's
counts and ZeRO's sharding read it, nothing else.

A replicated parameter is sharded over the ranks that hold it: a parameter of a
pipeline stage (in a Block, or in a module marked as a stage) over that stage's ranks
(the "zero" group), any other over the whole world (the two coincide without a
pipeline). A tensor-parallel slice differs between the tp ranks: only the ranks of
its data-parallel group hold copies of it, so its shards are spread over that group,
and its gradient is reduced there. With tp_size 1 the two coincide.

A tensor that a tensor-parallel layer holds whole on every tp rank and whose gradient
the layer makes whole there too (RowParallelLinear's bias, kind "tp_replicated";
BMTrain's `tp_mode` parameter without a split dimension) is placed as a slice is: its
shards spread over its data-parallel group only, its gradient is averaged there (not
over tp: every tp rank already holds all of it), and a gradient norm counts it on the
first tp rank only. Its state is the local tensor itself: nothing is gathered over tp.

Experts (nbtrain.moe) are slices too, of a tensor cut along its first dimension over
the expert-parallel group (kind "expert"): their shards spread over the
ranks holding the same experts (the "edp" group). Their gradients already sum every
ep rank's tokens, so they are divided by ep_size before the average over edp: the
result is the mean over all data-parallel ranks, as for every other parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..comm.context import get_context
from ..tensor_parallel.partial import TpLayout


@dataclass(frozen=True)
class ShardGroup:
    """The ranks of one kind of the topology's groups (`kind`: "dp", "edp", "zero";
    None: the world) with this rank's place in them."""

    kind: str | None
    rank: int
    size: int
    grad_scale: float = 1.0  # applied to a gradient before its average over `group`

    @property
    def group(self):
        """The process group (None: the world; `topology.ALONE`: this rank only), looked
        up at each use: after a failing cell the groups are made again
        (nbtrain.comm.recovery), and a collective on a group object kept from before
        aborted the process (SIGABRT in gloo, the next training cell)."""
        return None if self.kind is None else get_context().topology.group(self.kind)


def live_group(group):
    """The process group now for `group`: a kind of the topology's groups ("dp",
    "zero", ...) or a `ShardGroup` is looked up (groups are made again after a failing
    cell, and a collective on one kept from before aborts the process); a group object
    or None (the world) is itself."""
    if isinstance(group, str):
        return get_context().topology.group(group)
    if isinstance(group, ShardGroup):
        return group.group
    return group


@dataclass(frozen=True)
class Placement:
    """Where a parameter lives and who accounts for it: the one record nbtrain keeps
    per parameter, set where the parameter is placed (`place`) and read through
    `placement_of`.

    Attributes:
        kind: "replicated" (every holder has all of it), "tp_slice" (each tp rank a
            part, cut along `split_dim`), "tp_replicated" (whole on every tp rank, its
            gradient made whole there by the layer: a row-parallel bias) or "expert"
            (each ep rank a part of the experts' tensor, cut along `split_dim`).
        split_dim: the dimension a slice cuts (None for the other kinds).
        full_shape: the logical tensor's shape (slices and tp_replicated; None otherwise).
        parts: equal parts `split_dim` holds, each cut on its own (3: fused q, k, v).
        stage: held by one pipeline stage's ranks only (the stage's replicated
            parameters; for a module: it is a pipeline stage).
        tied_copy: a later stage's copy of a tied parameter: norms count the first only.
        owner: what reduces its gradient over data parallel besides sharding: "flat" (a
            Block's flat shard), "dp" (wrap()'s data-parallel buckets), None.
        flat: a flat shard's group (its frozen spans and segments, nbtrain.zero.freeze).
        tp_grad: a replicated parameter's gradient over tp, declared where the layout
            is made (`declare_tp_gradients`): "partial" (each tp rank sees its own
            tokens: summed over tp), "whole" (every tp rank sees every token), None
            (undeclared: the layout the tp layers make, nbtrain.tensor_parallel.partial).
        tp_layout: a replicated parameter's TpLayout in a tensor-parallel model.
    """

    kind: str = "replicated"
    split_dim: int | None = None
    full_shape: tuple | None = None
    parts: int = 1
    stage: bool = False
    tied_copy: bool = False
    owner: str | None = None
    flat: object = field(default=None, repr=False, compare=False)
    tp_grad: str | None = None
    tp_layout: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"placement kind {self.kind!r}: one of {', '.join(KINDS)}")

    @property
    def slice_group(self) -> str | None:
        """The group kind a slice is cut over: "tp", "ep" (experts), None (no slice)."""
        return {"tp_slice": "tp", "expert": "ep"}.get(self.kind)

    @property
    def shard_kind(self) -> str | None:
        """How its ZeRO shards are placed (`shard_group`'s argument): "tp", "ep",
        "tp_replicated" (over data parallel, as a tp slice), None (over every holder)."""
        return "tp_replicated" if self.kind == "tp_replicated" else self.slice_group

    def norm_part(self, sharded: bool, topo) -> int | None:
        """How a global gradient norm counts this parameter on this rank (`topo`: the
        topology): 0 summed over every rank (each element counted on one rank), 1 only
        rank 0's (the same on every rank), None not here (another rank counts it)."""
        if self.tied_copy:
            return None  # a tied parameter's copy on a later pipeline stage
        if sharded:
            if self.kind == "tp_replicated" and topo.tp_rank != 0:
                return None  # sharded over dp, the same on every tp rank: counted once
            return 0  # each element on one rank (tp slices ZeRO-sharded over dp too)
        if self.kind == "expert":
            return 0 if topo.edp_rank == 0 else None  # the first rank holding them
        if self.kind == "tp_slice":
            return 0 if topo.dp_rank == 0 else None  # its first replica, summed over tp
        if self.stage:
            return 0 if topo.dp_rank == 0 and topo.tp_rank == 0 else None
        return 1


KINDS = ("replicated", "tp_slice", "tp_replicated", "expert")
REPLICATED = Placement()
_ATTR = "nbtrain_placement"  # in the tensor's (or module's) __dict__


def placement_of(obj) -> Placement:
    """The placement record of a parameter (or whether a module is a pipeline stage):
    REPLICATED when nothing placed it (and for None: a module's unset parameter)."""
    return getattr(obj, "__dict__", {}).get(_ATTR, REPLICATED)


def place(obj, **fields) -> Placement:
    """Sets fields of `obj`'s placement record (the others kept) and returns it."""
    record = replace(placement_of(obj), **fields)
    obj.__dict__[_ATTR] = record
    return record


def copy_placement(src, dst) -> None:
    """`dst` gets `src`'s slice description (kind, split dimension, parts, full shape)
    and its declared gradient over tp: a ZeRO shard of a parameter is placed as the
    parameter is."""
    p = placement_of(src)
    place(
        dst,
        kind=p.kind,
        split_dim=p.split_dim,
        full_shape=p.full_shape,
        parts=p.parts,
        tp_grad=p.tp_grad,
    )


def _declared_tp_grad(placed: Placement) -> str | None:
    """A "tp_replicated" parameter's layer makes its gradient whole on every tp rank."""
    return "whole" if placed.kind == "tp_replicated" else placed.tp_grad


def tp_layout_over(params, group, names=None, fallback=None):
    """The TpLayout (nbtrain.tensor_parallel.partial) of replicated `params` that an
    owner reduces together over `group` (a kind, a ShardGroup or a process group):
    each one's declared `tp_grad`, or `fallback`'s (a Block's flat shard, which
    carries what was declared on the Block's parameters), read at the first backward."""
    params = list(params)

    def declared():
        backup = placement_of(fallback).tp_grad if fallback is not None else None
        return [_declared_tp_grad(placement_of(p)) or backup for p in params]

    if names is None:
        names = [f"a parameter of shape {tuple(p.shape)}" for p in params]
    return TpLayout(len(params), lambda: live_group(group), declared, names)


def full_numel(param) -> int:
    """How many elements the whole tensor has that `param` is a slice of (a tp layer's
    or experts' full shape), else `param`'s own: what the planner and the runtime
    count, whatever the tp and ep sizes."""
    full = placement_of(param).full_shape
    return math.prod(full) if full is not None else param.numel()


def is_slice(param) -> bool:
    """Whether `param` is a slice of a larger tensor: a tensor-parallel layer's (kind
    "tp_slice") or experts' ("expert"); `slice_kind` tells which."""
    return placement_of(param).slice_group is not None


def is_tp_replicated(param) -> bool:
    """Whether `param` is whole on every tp rank, with a gradient whole there too."""
    return placement_of(param).kind == "tp_replicated"


def slice_kind(param) -> str | None:
    """ "tp" for a tensor-parallel slice, "ep" for an expert slice, None otherwise."""
    return placement_of(param).slice_group


def shard_kind(param) -> str | None:
    """`Placement.shard_kind` of `param`."""
    return placement_of(param).shard_kind


def shard_group(tp_slice: bool | str | None = False, stage: bool = False) -> ShardGroup:
    """The ranks that shard a slice (`tp_slice`: True or "tp" for a tensor-parallel
    slice, "tp_replicated" for a tensor replicated over tp, "ep" for experts) or a
    replicated tensor of a pipeline stage (`stage`) or of every stage."""
    ctx = get_context()
    topo = ctx.topology
    if tp_slice == "ep":
        return ShardGroup("edp", topo.edp_rank, topo.dp_size // topo.ep_size, 1.0 / topo.ep_size)
    if tp_slice:
        return ShardGroup("dp", topo.dp_rank, topo.dp_size)
    if stage:
        return ShardGroup("zero", topo.zero_rank, topo.tp_size * topo.dp_size)
    return ShardGroup(None, ctx.rank, ctx.world_size)


def is_stage(module) -> bool:
    """Whether `module` is one pipeline stage's part of a model (nbtrain.pipeline.Stage)."""
    return placement_of(module).stage
