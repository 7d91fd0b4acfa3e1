"""Which ranks share the ZeRO shards of a parameter.

A replicated parameter is sharded over the ranks that hold it: a parameter of a
pipeline stage (in a Block, or in a module marked as a stage) over that stage's ranks
(the "zero" group), any other over the whole world (the two coincide without a
pipeline). A tensor-parallel slice differs between the tp ranks: only the ranks of
its data-parallel group hold copies of it, so its shards are spread over that group,
and its gradient is reduced there. With tp_size 1 the two coincide.

A tensor that a tensor-parallel layer holds whole on every tp rank and whose gradient
the layer makes whole there too (RowParallelLinear's bias, `tp_replicated = True`;
BMTrain's `tp_mode` parameter without a split dimension) is placed as a slice is: its
shards spread over its data-parallel group only, its gradient is averaged there (not
over tp: every tp rank already holds all of it), and a gradient norm counts it on the
first tp rank only. Its state is the local tensor itself: nothing is gathered over tp.

Experts (nbtrain.moe) are slices too, of a tensor cut along its first dimension over
the expert-parallel group (`tp_slice_group = "ep"`): their shards spread over the
ranks holding the same experts (the "edp" group). Their gradients already sum every
ep rank's tokens, so they are divided by ep_size before the average over edp: the
result is the mean over all data-parallel ranks, as for every other parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.context import get_context


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


def is_tp_slice(param) -> bool:
    return getattr(param, "tp_split_dim", None) is not None


def is_tp_replicated(param) -> bool:
    """Whether `param` is whole on every tp rank, with a gradient whole there too."""
    return bool(getattr(param, "tp_replicated", False)) and not is_tp_slice(param)


def slice_kind(param) -> str | None:
    """ "tp" for a tensor-parallel slice, "ep" for an expert slice, None otherwise."""
    if not is_tp_slice(param):
        return None
    return getattr(param, "tp_slice_group", "tp")


def shard_kind(param) -> str | None:
    """How `param`'s shards are placed: `slice_kind`'s "tp" or "ep", "tp_replicated"
    (`is_tp_replicated`: over data parallel, as a tp slice), None (over every holder)."""
    if is_tp_replicated(param):
        return "tp_replicated"
    return slice_kind(param)


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
    return bool(getattr(module, "_nbtrain_pipeline_stage", False))


def copy_tp_meta(src, dst) -> None:
    """Carries a tensor-parallel slice's split dimension, part count and full shape
    (and the mark of a tensor replicated over tp)."""
    for name in ("tp_split_dim", "tp_groups", "tp_full_shape", "tp_slice_group", "tp_replicated"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
