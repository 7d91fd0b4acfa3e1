"""DistributedParameter and DistributedModule: parameters sharded one by one.

Parameters inside a `Block` are stored in the block's flat buffers. Parameters
outside any block (embeddings, final norms, heads) are `DistributedParameter`s:
each rank stores ceil(numel / world) elements of the flattened tensor, and the
full tensor is gathered on use, with a reduce-scatter of its gradient in backward.

Where they are used:
  * in a `DistributedModule` (module.py), reading `self.weight` inside forward
    returns the gathered tensor (BMTrain's behaviour);
  * in any other module (after `wrap`), a forward pre-hook gathers the module's
    own distributed parameters for the duration of its forward (loose.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.context import get_context
from .partition import shard_range
from .placement import (
    ShardGroup,
    copy_placement,
    is_slice,
    is_tp_replicated,
    place,
    placement_of,
    shard_group,
    shard_kind,
    tp_layout_over,
)


class ParameterInitializer:
    """Deferred initialiser (BMTrain's name): `ParameterInitializer(f, *a, **kw)(t)`
    calls `f(t, *a, **kw)` on a full-shape tensor."""

    def __init__(self, func, *args, **kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs

    def __call__(self, tensor: torch.Tensor):
        return self.func(tensor, *self.args, **self.kwargs)

    def __repr__(self):
        return f"ParameterInitializer({getattr(self.func, '__name__', self.func)})"


def _local_slice(full: torch.Tensor, rank: int, world: int, device=None) -> torch.Tensor:
    """This rank's padded slice of `full` flattened (a copy)."""
    begin, end = shard_range(full.numel(), world, rank)
    out = torch.zeros(end - begin, dtype=full.dtype, device=device or full.device)
    if full.is_meta:  # built on the meta device: zeros until loaded
        return out
    flat = full.detach().reshape(-1)
    stop = min(end, flat.numel())
    if stop > begin:
        out[: stop - begin].copy_(flat[begin:stop])
    return out


_TENSOR_GRAD = torch._C.TensorBase.__dict__["grad"]  # the plain tensor's `.grad`


class DistributedParameter(nn.Parameter):
    """A parameter whose data is this rank's shard of the flattened full tensor.

    Args:
        data: the full tensor (any shape). Only this rank's slice is kept.
        requires_grad: as for nn.Parameter.
        init_method: callable applied to a full-shape tensor by
            `init_parameters(model)`; None keeps `data`.
        tp_slice_of: a tensor-parallel slice (a parameter of nbtrain.nn's parallel
            layers) that `data` holds, or a tensor they replicate over tp
            (placed "tp_replicated"): the shards spread over the ranks holding that slice
            (its data-parallel group) instead of the world, and the result keeps
            the slice's placement.
        stage: a parameter of one pipeline stage: sharded over that stage's ranks
            (otherwise over the world).

    Attributes:
        full_shape: torch.Size of the full tensor (for a tp slice: of the slice).
        shard_group: the ranks sharing the shards (a `ShardGroup`).
    """

    def __new__(
        cls,
        data: torch.Tensor,
        requires_grad: bool = True,
        init_method=None,
        *,
        tp_slice_of=None,
        stage: bool = False,
    ):
        ctx = get_context()
        group = shard_group(shard_kind(tp_slice_of) if tp_slice_of is not None else None, stage)
        local = _local_slice(
            data if data.is_meta else data.to(ctx.device), group.rank, group.size, ctx.device
        )
        param = super().__new__(cls, local, requires_grad)
        param.full_shape = torch.Size(data.shape)
        param.init_method = init_method
        param.shard_group = group
        if tp_slice_of is not None:
            copy_placement(tp_slice_of, param)
        return param

    # In a Block, the parameter shows this rank's part of the block's shard (BMTrain's
    # layout; members.py `become_part`): `.grad` reads the same part of the shard's
    # gradient, live, so the optimizer's zero_grad and the next backward show through.
    @property
    def grad(self):
        part = self.__dict__.get("_block_part")
        if part is None:
            return _TENSOR_GRAD.__get__(self)
        return part_grad(part)

    @grad.setter
    def grad(self, value):
        part = self.__dict__.get("_block_part")
        if part is None:
            _TENSOR_GRAD.__set__(self, value)
            return
        if value is None:  # the block's shard keeps its gradient: zero it through the
            return  # optimizer (zero_grad), which owns the shard
        group, span, _ = part
        if span is None:
            return
        shard = group.shard
        with torch.no_grad():
            if getattr(shard, "main_grad", None) is not None:
                shard.main_grad[span[0] : span[1]].copy_(value.reshape(-1))
                return
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            shard.grad[span[0] : span[1]].copy_(value.reshape(-1))

    def __deepcopy__(self, memo):
        # A copy of this rank's values (BMTrain's deepcopy also keeps only local
        # values); it belongs to no model and gathers nothing. Local. To copy a whole
        # sharded module use nbtrain.save/load.
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.detach().clone(), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        # Shards pickle as plain tensors (for pulling a value to the notebook).
        return torch.Tensor.__reduce_ex__(self.detach(), proto)

    @property
    def full_numel(self) -> int:
        return self.full_shape.numel()

    @property
    def in_block(self) -> bool:
        """Whether a Block holds this parameter's values (its `.data` then shows this
        rank's part of the block's shard, and `gather()` is refused)."""
        return self.__dict__.get("_block_part") is not None

    def gather(self) -> torch.Tensor:
        """The full tensor, autograd-aware. Collective: every rank calls this."""
        self._not_in_block("gather")
        return _GatherParam.apply(self)

    def gather_copy(self) -> torch.Tensor:
        """The full tensor, detached: a new tensor. Collective."""
        self._not_in_block("gather_copy")
        with torch.no_grad():
            full = _gather_full(self)
            return full.clone() if group_of(self).size == 1 else full

    def _not_in_block(self, what: str) -> None:
        if self.__dict__.get("_block_part") is not None:
            raise RuntimeError(
                f"{what}() of a DistributedParameter held by a Block: its values live in "
                "the block's flat shard. Read the full tensor inside the block's forward "
                "(the module's attribute), or with block.state_dict()."
            )

    def load_full_(self, value: torch.Tensor, name: str = "") -> None:
        """Keeps this rank's slice of a full tensor `value` (shape must match)."""
        if tuple(value.shape) != tuple(self.full_shape):
            raise ValueError(
                f"{name or 'parameter'}: checkpoint shape {tuple(value.shape)} "
                f"does not match the model's {tuple(self.full_shape)}"
            )
        group = self.shard_group
        with torch.no_grad():
            self.data.copy_(_local_slice(value.to(self.device, self.dtype), group.rank, group.size))


def part_grad(part) -> torch.Tensor | None:
    """A Block-held parameter's `.grad`: this rank's part of its block shard's gradient
    (`part` is (group, span, slot)); None when the shard has none, or the parameter was
    frozen in every backward since the shard's gradient was made (freeze.py). Local."""
    group, span, slot = part
    shard = group.shard
    grad = getattr(shard, "main_grad", None)
    grad = shard.grad if grad is None else grad
    if grad is None or not group.has_grad(slot):
        return None
    return grad[:0] if span is None else grad[span[0] : span[1]]


class Placeholder(torch.Tensor):
    """What a plain parameter a Block holds shows outside forward: a tensor on the
    meta device with the parameter's shape, dtype and requires_grad (`requires_grad_`
    on it freezes or trains the parameter at the next forward), whose `.grad` is this
    rank's part of the block shard's gradient, as a DistributedParameter's is. Made
    by `Placeholder.of`; operations on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(shape, dtype, requires_grad: bool) -> "Placeholder":
        meta = torch.empty(shape, dtype=dtype, device="meta")
        return torch.Tensor._make_subclass(Placeholder, meta, requires_grad)

    @property
    def grad(self):
        part = self.__dict__.get("_block_part")
        return None if part is None else part_grad(part)

    @grad.setter
    def grad(self, value):  # the block's shard keeps the gradient (its optimizer's)
        return

    def __deepcopy__(self, memo):  # a copy shows the shape only: it is in no block
        return torch.empty(self.shape, dtype=self.dtype, device="meta").requires_grad_(
            self.requires_grad
        )

    def __reduce_ex__(self, proto):
        return torch.Tensor.__reduce_ex__(self.__deepcopy__({}), proto)


def _allow_foreach_kernels() -> None:
    """torch's optimizers take their multi-tensor (foreach) path only for parameters
    whose type is exactly Tensor or Parameter; one DistributedParameter in a group sent
    the whole group down the per-tensor loop (a dozen small kernels per parameter per
    step). A DistributedParameter is a plain Parameter to every kernel, so it joins."""
    import importlib

    # The optimizers' list, and the one clip_grad_norm_ and friends read.
    for name in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        try:
            supported = importlib.import_module(name)._foreach_supported_types
        except (ImportError, AttributeError):  # another torch: it decides as it did
            continue
        if isinstance(supported, list) and DistributedParameter not in supported:
            supported.append(DistributedParameter)


_allow_foreach_kernels()


def group_of(param: DistributedParameter) -> ShardGroup:
    """The ranks sharing `param`'s shards (the world for one made before groups)."""
    group = getattr(param, "shard_group", None)
    return group if group is not None else shard_group()


def _gather_full(param: DistributedParameter) -> torch.Tensor:
    group = group_of(param)
    if group.size == 1:  # the shard is the whole tensor: a view, no copy
        return param.detach().view(-1)[: param.full_numel].view(param.full_shape)
    flat = torch.empty(param.numel() * group.size, dtype=param.dtype, device=param.device)
    C.all_gather(flat, param.detach(), group=group.group, label="param")
    return flat[: param.full_numel].view(param.full_shape)


def tp_layout(param: DistributedParameter):
    """A replicated parameter's TpLayout in a tensor-parallel model (else None)."""
    layout = placement_of(param).tp_layout
    whole = is_slice(param) or is_tp_replicated(param)  # never partial over tp
    if layout is None and not whole and get_context().topology.tp_size > 1:
        layout = place(param, tp_layout=tp_layout_over([param], group_of(param))).tp_layout
    return layout


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param):
        ctx.numel, ctx.group = param.numel(), group_of(param)
        ctx.tp_layout = tp_layout(param)
        return _gather_full(param)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        if group.size == 1:  # nothing to reduce
            grad = grad.reshape(-1)
            return grad * group.grad_scale if group.grad_scale != 1.0 else grad
        flat = torch.zeros(ctx.numel * group.size, dtype=grad.dtype, device=grad.device)
        flat[: grad.numel()].copy_(grad.reshape(-1))
        if group.grad_scale != 1.0:  # experts: a sum over the ep ranks' tokens
            flat.mul_(group.grad_scale)
        if ctx.tp_layout is not None:  # sequence parallel: a sum over tp (tensor_parallel.partial)
            ctx.tp_layout.apply([flat])
        out = torch.empty(ctx.numel, dtype=grad.dtype, device=grad.device)
        C.reduce_scatter(out, flat, op="avg", group=group.group, label="param.grad")
        return out


# -- state dict conversion for modules holding DistributedParameters ----------


def _save_hook(module, state_dict, prefix, local_metadata):
    for name, param in module._parameters.items():
        if is_slice(param):
            continue  # the tp layer's own hook gathers the full tensor
        if isinstance(param, DistributedParameter) and prefix + name in state_dict:
            state_dict[prefix + name] = param.gather_copy()


def _load_pre_hook(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
):
    for name, param in module._parameters.items():
        key = prefix + name
        if isinstance(param, DistributedParameter) and key in state_dict:
            value = state_dict[key]
            if tuple(value.shape) != tuple(param.full_shape):
                raise ValueError(
                    f"load_state_dict: {key!r} has shape {tuple(value.shape)} in "
                    f"the state dict but {tuple(param.full_shape)} in the model"
                )
            group = group_of(param)
            state_dict[key] = _local_slice(value, group.rank, group.size)


# The modules given _save_hook and _load_pre_hook (once each).
_SD_HOOKED: weakref.WeakSet = weakref.WeakSet()


def attach_state_dict_hooks(module: nn.Module) -> None:
    """Makes `module.state_dict()` hold full tensors for its DistributedParameters
    and `load_state_dict` accept full tensors. Idempotent."""
    if module in _SD_HOOKED:
        return
    module._register_state_dict_hook(_save_hook)
    module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
    _SD_HOOKED.add(module)
