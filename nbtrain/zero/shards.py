"""What this rank holds of a sharded model, for readers outside nbtrain.zero.

Inspection, checkpoints, telemetry and the notebook read a model's shards through
these calls, never through a Block's flat groups or a parameter's private fields,
so the storage can change without them noticing:

    for shard in nbtrain.zero.shards(model):       # one per distinct parameter
        shard.name, shard.shape, shard.values      # this rank's real elements
    for buffer in nbtrain.zero.flat_buffers(model):  # one per Block flat buffer
        buffer.numel, buffer.shard.numel()         # real elements, this rank's slice

Both are local: they read what this rank holds and communicate nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from .block import Block
from .parameter import DistributedParameter, group_of
from .partition import shard_range
from .placement import ShardGroup, is_slice, placement_of


class ShardKind(enum.Enum):
    """Where a parameter's values live on this rank."""

    BLOCK = "block"  # a part of a Block's flat buffer
    PARAMETER = "parameter"  # a DistributedParameter outside any Block
    REPLICATED = "replicated"  # a plain parameter: every rank holds it whole


@dataclass(frozen=True)
class Shard:
    """This rank's part of one parameter.

    Attributes:
        names: the parameter's names in `model.state_dict()`, first name first (a
            tied parameter has several).
        shape: the full tensor's shape (a tensor-parallel slice: this tp rank's slice).
        dtype: the stored dtype.
        values: this rank's real elements (no padding): a 1-D view into the stored
            tensor, detached, on the device (host memory for an offloaded Block).
            Writing it under `torch.no_grad()` writes the model. Empty when this rank
            holds none of the parameter; the whole tensor for REPLICATED.
        grad: the same elements of the gradient, or None. A Block's parameter: its
            shard's gradient (the `main_grad` when the block reduces in a wider
            dtype); otherwise the parameter's `.grad`.
        start: where `values[0]` sits in the flattened full tensor.
        kind: a ShardKind.
        ranks: the ranks sharing the parameter's shards (REPLICATED: None).
        tp: a tensor-parallel (or expert) slice's Placement (its split dimension,
            full shape and parts), else None.
        param: the parameter object the user holds (PARAMETER, REPLICATED, or a
            DistributedParameter a Block holds), else None.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    grad: torch.Tensor | None
    start: int
    kind: ShardKind
    ranks: ShardGroup | None = None
    tp: object | None = None
    param: nn.Parameter | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        """One past the last element of `values` in the flattened full tensor."""
        return self.start + self.values.numel()


def _shard_grad(shard: torch.Tensor) -> torch.Tensor | None:
    grad = getattr(shard, "main_grad", None)
    return shard.grad if grad is None else grad


def _block_shards(block: Block, base: str) -> list[Shard]:
    out = []
    for group in block.groups:
        begin, end = group.layout.shard_range(group.rank)
        local, grad = group.shard.detach(), _shard_grad(group.shard)
        for slot, entry in zip(group.layout.slots, group.entries):
            lo, hi = slot.local_part(begin, end) or (slot.offset, slot.offset)
            cut = slice(lo - begin, hi - begin) if hi > lo else slice(0, 0)
            out.append(
                Shard(
                    tuple(base + n for n in entry.names),
                    slot.shape,
                    local.dtype,
                    local[cut],
                    None if grad is None else grad.detach()[cut],
                    lo - slot.offset,
                    ShardKind.BLOCK,
                    group.ranks,
                    entry.tp,
                    entry.member,
                )
            )
    return out


def _param_shard(name: str, param: nn.Parameter) -> Shard:
    grad = param.grad
    if isinstance(param, DistributedParameter):
        ranks = group_of(param)
        begin, _ = shard_range(param.full_numel, ranks.size, ranks.rank)
        real = max(0, min(param.numel(), param.full_numel - begin))  # no padding
        return Shard(
            (name,),
            tuple(param.full_shape),
            param.dtype,
            param.detach().reshape(-1)[:real],
            None if grad is None else grad.detach().reshape(-1)[:real],
            min(begin, param.full_numel),
            ShardKind.PARAMETER,
            ranks,
            placement_of(param) if is_slice(param) else None,
            param,
        )
    return Shard(
        (name,),
        tuple(param.shape),
        param.dtype,
        param.detach().reshape(-1),
        None if grad is None else grad.detach().reshape(-1),
        0,
        ShardKind.REPLICATED,
        None,
        placement_of(param) if is_slice(param) else None,
        param,
    )


def shards(model: nn.Module) -> list[Shard]:
    """One Shard per distinct parameter of `model`, in the model's order (a Block's
    parameters where the Block sits, each flat buffer's in turn). Local.

    Args:
        model: a plain or sharded model (Blocks, DistributedParameters, wrap()).
    """
    out: list[Shard] = []
    index: dict[int, int] = {}  # id(parameter) -> position in out
    for prefix, module in model.named_modules():
        base = prefix + "." if prefix else ""
        if isinstance(module, Block):  # its module's parameters live in flat buffers
            out += _block_shards(module, base)
            continue
        for name, param in module._parameters.items():
            if param is None:
                continue
            at = index.get(id(param))
            if at is not None:  # tied: one more name for the same parameter
                out[at] = replace(out[at], names=out[at].names + (base + name,))
                continue
            index[id(param)] = len(out)
            out.append(_param_shard(base + name, param))
    return out


@dataclass(frozen=True)
class FlatMember:
    """One parameter's place in a flat buffer (its elements [offset, offset + numel))."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int
    tp: object | None  # a tensor-parallel slice's metadata, else None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatBuffer:
    """One flat buffer of a Block, as this rank holds it.

    Attributes:
        name: the shard's name in `model.named_parameters()` ("layers.0.flat_param_0").
        label: the buffer's name in telemetry events ("layers.0.0").
        shard: this rank's slice, an nn.Parameter (one of `block.parameters()`),
            `padded_numel / ranks.size` elements.
        numel: real elements of the whole buffer (its parameters back to back).
        padded_numel: numel rounded up to a multiple of the group's size.
        start: where this rank's slice begins in the buffer.
        ranks: the ranks sharing the buffer.
        members: the parameters in it, in order.
        gathered_nbytes: bytes of the gathered buffer on this rank when read (0 when
            released, and always for a group of one, whose shard is the buffer).
    """

    name: str
    label: str
    shard: nn.Parameter
    numel: int
    padded_numel: int
    start: int
    ranks: ShardGroup
    members: tuple[FlatMember, ...]
    gathered_nbytes: int


def flat_buffers(model: nn.Module) -> list[FlatBuffer]:
    """Every flat buffer of the Blocks in `model` (a Block itself included), in the
    model's order, names prefixed by the Block's path. Local."""
    out = []
    for prefix, module in model.named_modules():
        if not isinstance(module, Block):
            continue
        base = prefix + "." if prefix else ""
        for i, group in enumerate(module.groups):
            layout = group.layout
            members = tuple(
                FlatMember(tuple(base + n for n in e.names), s.shape, s.offset, e.tp)
                for s, e in zip(layout.slots, group.entries)
            )
            gathered = 0 if group.alias else group.full.untyped_storage().nbytes()
            out.append(
                FlatBuffer(
                    f"{base}flat_param_{i}",
                    group.label,
                    group.shard,
                    layout.numel,
                    layout.padded_numel,
                    layout.shard_range(group.rank)[0],
                    group.ranks,
                    members,
                    gathered,
                )
            )
    return out


def is_sharded(param: torch.Tensor) -> bool:
    """Whether each element of `param` lives on exactly one rank of its group: a
    DistributedParameter or a Block's flat shard (so a norm sums over ranks)."""
    return isinstance(param, DistributedParameter) or placement_of(param).owner == "flat"


def has_grad_owner(param: torch.Tensor) -> bool:
    """Whether something of nbtrain.zero reduces `param`'s gradient over its
    data-parallel ranks: sharded (`is_sharded`), or a replicated parameter of a
    DistributedModule or wrap()'s data-parallel buckets."""
    return is_sharded(param) or placement_of(param).owner == "dp"
