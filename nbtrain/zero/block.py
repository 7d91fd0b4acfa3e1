"""Block: a module whose parameters live in flat, sharded buffers (ZeRO-2/3).

    block = Block(layer, zero_level=3)      # block(x) equals layer(x)

The wrapped module's parameters move into one flat buffer per (dtype,
requires_grad); this rank keeps one contiguous shard of each as an ordinary
`nn.Parameter` (`block.parameters()`), so any optimizer updates shards. Inside
forward the module sees full tensors: views into the gathered buffer.

Lifecycle of one training step (ZeRO-3):
  forward:  gather (or wait for the prefetch started by the previous block),
            start the next block's gather, compute, release (the last block of
            a list stays gathered: its backward comes next).
  backward: `_BlockExit` runs first: re-gather (or wait for the prefetch the
            next block started), start the previous block's gather; the module's
            backward runs; `_GatherFlat` reduce-scatters the gradient
            asynchronously and releases the buffer.
ZeRO-2 keeps the buffer gathered from forward until its gradient is reduced.

Names add no level: the block shares the module's submodules and buffers, and
`state_dict()` holds full tensors under the module's own names.

Tensor-parallel slices (the weights of nbtrain.nn's parallel layers) go into flat
buffers of their own, sharded over the data-parallel group of this rank's tp slot
(the ranks holding the same slice); `state_dict()` gathers them over tp into the
full logical tensors, and `load_state_dict` takes full tensors or this rank's slices.
"""

from __future__ import annotations

import enum
import time

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..comm import events
from ..comm.context import get_context
from . import block_state
from .compile import CompiledModule, CompileStats, compile_options
from .entries import ParamEntry, collect_entries
from .flat import FlatGroup
from .init import init_block
from .members import become_part, sync_requires_grad
from .named_members import NamedMembers
from .parameter import DistributedParameter, Placeholder
from .partition import FlatLayout
from .placement import place, shard_group, shard_kind, tp_layout_over
from .reducer import GradReducer
from .root_map import ROOTS


class ZeroLevel(enum.IntEnum):
    """What stays gathered between forward and backward."""

    GRADS_SHARDED = 2  # ZeRO-2: parameters stay gathered from forward to backward
    FULLY_SHARDED = 3  # ZeRO-3: parameters gathered again for backward

    @classmethod
    def parse(cls, value) -> "ZeroLevel":
        try:
            return cls(int(value))
        except (ValueError, TypeError):
            raise ValueError(
                f"zero_level={value!r}: use 2 (keep parameters gathered from "
                "forward to backward) or 3 (gather again for backward)"
            ) from None


class Block(nn.Module):
    """Shards `module`'s parameters ZeRO-style; `Block(m)(x)` equals `m(x)`.

    Args:
        module: any nn.Module. One without parameters (dropout, an activation, a
            residual wrapper) makes a block that gathers nothing and only runs it.
        zero_level: 2 or 3 (see ZeroLevel).
        use_checkpoint: recompute the module's activations in backward (BMTrain's
            default, True): the module's forward runs again in backward. False keeps
            them (more memory, less compute; the same results).
        label: name used in telemetry. By default the module's class name until
            the block joins a model (`wrap`, or the end of a DistributedModule's
            construction),
            which names it by its path in the model ("layers.3").
        reduce_dtype: dtype gradients are reduce-scattered in (None: the
            parameters' own). torch.float32 for bf16/fp16 parameters keeps the
            averaged gradient in fp32 as each shard's `main_grad`.
        offload: keep the shards (and so their gradients and the optimizer's state)
            in host memory, copied to the device for each gather (ZeRO-Offload). The
            same code runs on a CPU-only machine, where host and device coincide.
        mode: BMTrain's "BLOCK" (default) or "PIPE" (a block of a
            PipelineTransformerBlockList). nbtrain shards every block over the ranks
            of its pipeline stage either way, so both build the same block.
        initialized: BMTrain's flag, accepted; nbtrain takes the module's values as
            they are (and `init_parameters` runs the deferred initialisers) either way.
        compile: torch.compile the module (see `compile`): True, or a dict of
            torch.compile's keywords (e.g. dict(backend="aot_eager")). False: eager.

    BMTrain's positional order, `Block(module, use_checkpoint, zero_level)`, works too:
    a bool in second place is `use_checkpoint` (no zero level is a bool).

    Outputs come back as the module returns them, a list as a tuple (BMTrain's). A
    block none of whose parameters trains, fed inputs that need no gradient, returns
    outputs without a grad_fn and runs its module once. `requires_grad_(False)` on one
    parameter the block holds freezes that parameter alone (freeze.py), between steps
    too; on `block.parameters()` (the flat shards) every parameter of that shard.

    A DistributedParameter of the module stays the user's object: outside forward its
    `.data` is this rank's part of it in the block's shard (1-D, maybe empty) and its
    `.grad` the same part of the shard's gradient, as in BMTrain; `block.parameters()`
    are the flat shards themselves. A plain parameter shows as a placeholder on the
    meta device outside forward (`parameter.Placeholder`: its `.grad` reads this
    rank's part of the shard's gradient).

    Construction is collective when the module holds DistributedParameters.
    Forward and backward are collective: every rank runs the same blocks in the
    same order.
    """

    def __init__(
        self,
        module: nn.Module,
        zero_level: int = 3,
        use_checkpoint: bool = True,
        label: str | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload: bool = False,
        mode: str = "BLOCK",
        initialized: bool = False,
        compile: bool | dict = False,  # noqa: A002 (the public keyword)
    ):
        super().__init__()
        options = compile_options(compile)
        if isinstance(zero_level, bool):  # BMTrain's order: (module, use_checkpoint, zero_level)
            zero_level, use_checkpoint = (
                (3 if isinstance(use_checkpoint, bool) else use_checkpoint),
                zero_level,
            )
        if mode not in ("BLOCK", "PIPE"):
            raise ValueError(
                f'Block(mode={mode!r}): use "BLOCK" (the default) or "PIPE" '
                "(a block of a PipelineTransformerBlockList)"
            )
        self.mode = mode
        self.offload = bool(offload)
        level = ZeroLevel.parse(zero_level)
        entries = collect_entries(module)  # none (dropout, an activation): a block that only runs
        ctx = get_context()
        for sub in module.modules():
            # A DistributedModule inside gave its plain parameters data-parallel
            # gradients; their storage moves into this block, which reduces them now.
            old_root = ROOTS.pop(sub, None)
            if old_root is not None:
                old_root.release()
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_next_block", None)
        object.__setattr__(self, "_prev_block", None)
        object.__setattr__(self, "_compiled", None)
        self.zero_level, self.use_checkpoint = level, bool(use_checkpoint)
        self.label = label or type(module).__name__
        self.auto_label = label is None
        # Until a model adopts this block, it reduces through a queue of its own.
        self.reducer = GradReducer()
        # Share, not copy: the block adds no level to names.
        self._modules = module._modules
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._build_groups(entries, ctx, reduce_dtype)
        self._init_order = entries  # the module's parameter order, for init_parameters
        self._parameters = NamedMembers(self._parameters, self)  # named_members.py
        self.register_load_state_dict_post_hook(Block._drop_own_keys)
        self._bwd_start = 0.0
        self._grads_pending = 0
        if options is not None:
            self.compile(**options)

    # -- construction -------------------------------------------------------
    def _build_groups(self, entries: list[ParamEntry], ctx, reduce_dtype=None) -> None:
        by_key: dict = {}
        for entry in entries:
            key = (entry.param.dtype, entry.param.requires_grad, shard_kind(entry.param))
            by_key.setdefault(key, []).append(entry)
        self._groups: list[FlatGroup] = []
        self._init_methods: list[list] = []
        for i, ((dtype, requires_grad, kind), group_entries) in enumerate(by_key.items()):
            ranks = shard_group(kind, stage=True)  # a block lives on one stage
            values, inits = [], []
            for entry in group_entries:
                p = entry.param
                if isinstance(p, DistributedParameter):
                    values.append(p.gather_copy())
                    inits.append(p.init_method)
                else:
                    values.append(p.detach())
                    # A plain parameter may carry one (`zero.init.assign_inits`; a model
                    # built on the meta device has nothing else to start from).
                    inits.append(getattr(p, "init_method", None))
            layout = FlatLayout.build(
                [(e.names[0], tuple(v.shape)) for e, v in zip(group_entries, values)], ranks.size
            )
            group = FlatGroup(
                layout,
                values,
                ranks=ranks,
                device=ctx.device,
                dtype=dtype,
                requires_grad=requires_grad,
                label=f"{self.label}.{i}",
                reducer=self.reducer,
                grad_dtype=reduce_dtype,
                offload=self.offload,
            )
            group.on_grad_ready = self._grad_ready
            group.entries = group_entries
            if kind is None and ctx.topology.tp_size > 1:
                group.tp_layout = tp_layout_over(
                    [e.param for e in group_entries],
                    ranks,
                    names=[f"{self.label}.{e.names[0]}" for e in group_entries],
                    fallback=group.shard,  # declared on the Block's parameters
                )
            if kind == "tp_replicated":  # the same shard on every tp rank: a norm's once
                place(group.shard, kind="tp_replicated")
            self.register_parameter(f"flat_param_{i}", group.shard)
            self._groups.append(group)
            self._init_methods.append(inits)
            begin, end = group.layout.shard_range(group.rank)
            for index, (slot, entry) in enumerate(zip(layout.slots, group_entries)):
                if entry.member is not None:
                    become_part(
                        entry.member,
                        group,
                        slot.local_part(begin, end),
                        slot.offset,
                        begin,
                        index,
                    )
                    entry.rest = entry.member
                else:
                    # Outside forward the module shows a placeholder with the right
                    # shape and dtype (and requires_grad: freezing it freezes the
                    # parameter); forward installs real views.
                    entry.rest = Placeholder.of(entry.param.shape, dtype, requires_grad)
                    local = slot.local_part(begin, end)
                    span = None if local is None else (local[0] - begin, local[1] - begin)
                    entry.rest._block_part = (group, span, index)
                for mod, pname in entry.owners:
                    del mod._parameters[pname]
                    mod.__dict__[pname] = entry.rest
                entry.param = None  # the full tensor must not outlive construction

    @staticmethod
    def _install_views(group: FlatGroup, full: torch.Tensor, trainable) -> None:
        for view, entry, train in zip(group.param_views(full), group.entries, trainable):
            if not train:  # frozen alone: autograd computes no gradient for it
                view = view.detach()
            for mod, pname in entry.owners:
                mod.__dict__[pname] = view  # shadows nothing: the Parameter is gone

    @property
    def inner_module(self) -> nn.Module:
        """The module this block wraps (BMTrain's argument name)."""
        return self._module

    def twin(self) -> "Block":
        """Another Block over the same module and the same flat shards: the layer used
        a second time (a TransformerBlockList given one plain module twice builds
        this, as BMTrain's list does). Each use gathers and releases as a block of
        its own; both uses' gradients add into the shards. Local."""
        twin = Block.__new__(Block)
        nn.Module.__init__(twin)
        for name in ("_module", "_compiled"):
            object.__setattr__(twin, name, self.__dict__[name])
        object.__setattr__(twin, "_next_block", None)
        object.__setattr__(twin, "_prev_block", None)
        twin.mode, twin.offload = self.mode, self.offload
        twin.zero_level, twin.use_checkpoint = self.zero_level, self.use_checkpoint
        twin.label, twin.auto_label, twin.reducer = self.label, self.auto_label, self.reducer
        twin._modules, twin._buffers = self._modules, self._buffers
        twin._non_persistent_buffers_set = self._non_persistent_buffers_set
        twin._groups, twin._init_methods = self._groups, self._init_methods
        for i, group in enumerate(self._groups):
            twin.register_parameter(f"flat_param_{i}", group.shard)
        twin.register_load_state_dict_post_hook(Block._drop_own_keys)
        twin._bwd_start, twin._grads_pending = 0.0, 0
        twin.training = self.training
        return twin

    @property
    def groups(self) -> list[FlatGroup]:
        return self._groups

    def join(self, reducer: GradReducer, label: str | None = None) -> None:
        """Makes this block reduce through `reducer` (its model's) and, if it was
        not named explicitly, renames it `label`. Local."""
        self.reducer = reducer
        if label is not None and self.auto_label:
            self.label = label
        for i, group in enumerate(self._groups):
            group.reducer = reducer
            group.label = f"{self.label}.{i}"

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_module")
            if module is None:
                raise
            return getattr(module, name)

    def extra_repr(self) -> str:
        return f"zero_level={int(self.zero_level)}, use_checkpoint={self.use_checkpoint}" + (
            ", compiled" if self._compiled is not None else ""
        )

    def compile(self, **options) -> None:
        """`torch.compile(module, **options)` for the wrapped module only: the block's
        gather, prefetch, release and gradient reduction stay eager around it, and
        `state_dict()` names stay the module's own. Compiles at the first forward; blocks
        of one module class share the code. `compile_stats` then holds the graph breaks
        (a warning names the block when there are any). Raises a RuntimeError when
        torch.compile cannot run here. Local."""
        object.__setattr__(
            self, "_compiled", CompiledModule(self._module, options, get_context().device)
        )

    @property
    def compile_stats(self) -> CompileStats | None:
        """Graphs and graph breaks of the compiled module, known after the first
        forward; None when the block is not compiled or has not run."""
        return None if self._compiled is None else self._compiled.stats

    def train(self, mode: bool = True):
        super().train(mode)
        self._module.training = mode
        return self

    # -- gathering --------------------------------------------------------------
    def prefetch(self) -> None:
        """Starts the all-gather of every group (async). Collective."""
        for group in self._groups:
            group.start_gather()

    def _gather(self, neighbour: "Block | None") -> None:
        self.prefetch()
        if neighbour is not None:
            neighbour.prefetch()
        for group in self._groups:
            group.wait_gather()

    def release(self) -> None:
        for group in self._groups:
            group.release()

    # -- forward ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        sync_requires_grad(self._groups, self.label)
        self._gather(self._next_block)
        fulls = [g.full_tensor(self._grad_ready) for g in self._groups]
        masks = [tuple(g.trainable) for g in self._groups]
        wants_grad = torch.is_grad_enabled() and (
            any(g.requires_grad for g in self._groups)
            or any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in pytree.tree_leaves((args, kwargs))
            )
        )
        with events.compute_span(self.label, "forward"):
            if self.use_checkpoint and wants_grad:
                out = checkpoint(self._run, fulls, masks, args, kwargs, use_reentrant=False)
            else:
                out = self._run(fulls, masks, args, kwargs)
        if isinstance(out, list):  # BMTrain's blocks return a tuple
            out = tuple(out)
        flat, spec = pytree.tree_flatten(out)
        needs_grad = [
            i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not (torch.is_grad_enabled() and needs_grad):
            self.release()  # no backward will come for this call
            return out
        if self.zero_level == ZeroLevel.FULLY_SHARDED and not self._last_in_list():
            self.release()
        exits = _BlockExit.apply(self, *[flat[i] for i in needs_grad])
        for i, t in zip(needs_grad, exits):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    def _run(self, fulls, masks, args, kwargs):
        for group, full, mask in zip(self._groups, fulls, masks):
            self._install_views(group, full, mask)
        try:
            if self._compiled is not None:
                return self._compiled(self.label, *args, **kwargs)
            return self._module(*args, **kwargs)
        finally:  # autograd keeps the views it needs; the attributes go back to rest
            for group in self._groups:
                for entry in group.entries:
                    for mod, pname in entry.owners:
                        mod.__dict__[pname] = entry.rest

    def _last_in_list(self) -> bool:
        """The last block of a list stays gathered from its forward into its backward:
        backward starts with it, so releasing and gathering it again would only add
        an all-gather a step."""
        return self._next_block is None and self._prev_block is not None

    # -- backward ---------------------------------------------------------------
    def _begin_backward(self) -> None:
        events.instant("compute_begin", self.label, phase="backward")
        prev = self._prev_block if self.zero_level == ZeroLevel.FULLY_SHARDED else None
        self._gather(prev)
        # The span starts once the parameters are here: waiting for the gather
        # is not compute, and counting it as such would inflate hidden comm.
        self._bwd_start = time.perf_counter()
        self._grads_pending = sum(g.requires_grad for g in self._groups)
        if self._grads_pending == 0:
            self.reducer.at_end(self.release)

    def _grad_ready(self) -> None:
        """Called by each trainable group's backward, before its reduce-scatter."""
        self._grads_pending -= 1
        if self._grads_pending > 0:
            return
        events.compute(self.label, "backward", self._bwd_start, time.perf_counter())
        self.release()

    # -- state dict -------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        params, self._parameters = self._parameters, {}
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._parameters = params
        destination.update(self.full_items(prefix))

    def full_items(self, prefix: str = "", copy: bool = True, groups=None):
        """(name, full tensor) of every parameter, one flat group gathered at a time (a
        tensor-parallel slice assembled whole). `copy=False` gives views into the
        gathered group instead of copies (a streaming writer's: one group's memory).
        `groups`: only these of the block's flat groups. Collective: every rank of
        the block's groups iterates in step."""
        yield from block_state.full_items(self._groups if groups is None else groups, prefix, copy)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        params, self._parameters = self._parameters, {}
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            self._parameters = params
        own = block_state.load_groups(self._groups, state_dict, prefix, missing_keys)
        unexpected_keys[:] = [k for k in unexpected_keys if k not in own]
        # The module's own submodules load after this and would call our keys
        # unexpected (their Parameters moved here): the post-hook drops them.
        self._loaded_keys = own

    @staticmethod
    def _drop_own_keys(block, incompatible_keys) -> None:
        own = getattr(block, "_loaded_keys", set())
        incompatible_keys.unexpected_keys[:] = [
            k for k in incompatible_keys.unexpected_keys if k not in own
        ]

    # -- deferred initialisation ------------------------------------------------
    def init_parameters(self, prefix: str = "", by_name: bool = False) -> None:
        """Runs the deferred initialisers into this rank's part of every parameter
        (zero/init.py: BMTrain's draw from the current generator, or `by_name`)."""
        init_block(self, prefix, by_name)

    def full_named_grads(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Gathered gradients by parameter name (None-grads skipped). Collective."""
        return block_state.full_named_grads(self._groups, prefix)


class _BlockExit(torch.autograd.Function):
    """Identity on the block's outputs; its backward runs before the block's."""

    @staticmethod
    def forward(ctx, block, *outputs):
        ctx.block = block
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.block._begin_backward()
        return (None, *grads)
