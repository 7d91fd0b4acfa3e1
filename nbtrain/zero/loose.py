"""One all-gather and one reduce-scatter per step for the parameters outside blocks.

wrap() leaves embeddings, final norms and heads as DistributedParameters.
Gathered one at a time, per use, a small GPT pays 5 blocking all-gathers and 5
blocking reduce-scatters per step for them (its tied embedding twice each way);
on 2 gloo ranks that was the larger part of ZeRO-3's gap to DDP on the tiny
preset (44 ms against 21 ms a step). Here the root module's forward gathers all
of them in one collective per dtype, and every use reads the same gathered
tensor, so autograd sums the gradients of all uses (both ends of a tied
embedding) before one reduce-scatter at the end of backward.

Cost: every loose parameter is whole for the length of the root's forward
(FSDP2 keeps its root group unsharded the same way); those that backward needs
stay until it runs, as before.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from .parameter import DistributedParameter, group_of, tp_layout


class _GatherMany(torch.autograd.Function):
    """Shards of several DistributedParameters -> their full tensors, one collective."""

    @staticmethod
    def forward(ctx, ranks, *params):
        world = ranks.size
        ctx.ranks, ctx.meta = ranks, [(p.numel(), p.full_shape) for p in params]
        ctx.tp_layouts = [tp_layout(p) for p in params]
        # A wider reduce dtype (wrap's reduce_dtype: fp32 for bf16 parameters): the
        # gradients are reduced in it and kept as each shard's `main_grad`, as a Block's.
        wide = getattr(params[0], "reduce_dtype", None)
        ctx.wide = wide if wide is not None and wide != params[0].dtype else None
        ctx.params = params if ctx.wide is not None else None
        if world == 1:  # each shard is the whole tensor: views, no copy
            return tuple(
                p.detach().view(-1)[: shape.numel()].view(shape)
                for p, (_, shape) in zip(params, ctx.meta)
            )
        local = torch.cat([p.detach().reshape(-1) for p in params])  # copy-in: one buffer
        out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        C.all_gather(out, local, group=ranks.group, label="loose")
        rows, fulls, offset = out.view(world, local.numel()), [], 0
        for numel, shape in ctx.meta:
            full = rows[:, offset : offset + numel].reshape(-1)[: shape.numel()]
            fulls.append(full.view(shape))
            offset += numel
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        world, total = ctx.ranks.size, sum(n for n, _ in ctx.meta)
        if ctx.wide is not None:
            grads = [None if g is None else g.to(ctx.wide) for g in grads]
        if world == 1:
            shard_grads = [
                None
                if g is None or not ctx.needs_input_grad[i + 1]
                else g.reshape(-1).mul(ctx.ranks.grad_scale)
                if ctx.ranks.grad_scale != 1.0
                else g.reshape(-1)
                for i, g in enumerate(grads)
            ]
            return (None, *_to_main_grad(ctx, shard_grads))
        ref = next(g for g in grads if g is not None)
        flat = torch.zeros(world, total, dtype=ref.dtype, device=ref.device)
        offset = 0
        for (numel, shape), grad in zip(ctx.meta, grads):
            if grad is not None:
                padded = F.pad(grad.reshape(-1), (0, world * numel - shape.numel()))
                flat[:, offset : offset + numel].copy_(padded.view(world, numel))
            offset += numel
        if ctx.ranks.grad_scale != 1.0:  # experts: a sum over the ep ranks' tokens
            flat.mul_(ctx.ranks.grad_scale)
        offset = 0
        for (numel, _), layout, grad in zip(ctx.meta, ctx.tp_layouts, grads):
            if layout is not None:  # sequence parallel: a sum over tp (tensor_parallel.partial)
                layout.apply([None if grad is None else flat[:, offset : offset + numel]])
            offset += numel
        out = torch.empty(total, dtype=ref.dtype, device=ref.device)
        C.reduce_scatter(out, flat.view(-1), op="avg", group=ctx.ranks.group, label="loose.grad")
        shard_grads, offset = [], 0
        for i, (numel, _) in enumerate(ctx.meta):
            wanted = ctx.needs_input_grad[i + 1]
            shard_grads.append(out[offset : offset + numel].clone() if wanted else None)
            offset += numel
        return (None, *_to_main_grad(ctx, shard_grads))


def _to_main_grad(ctx, shard_grads: list) -> list:
    """Reduced in a wider dtype: each gradient joins its shard's `main_grad` (what
    nbtrain's optimizers read for fp32 master weights) and autograd gets None."""
    if ctx.wide is None:
        return shard_grads
    for param, grad in zip(ctx.params, shard_grads):
        if grad is None:
            continue
        main = getattr(param, "main_grad", None)
        if main is None:
            param.main_grad = grad
        else:
            main.add_(grad)
    return [None] * len(shard_grads)


def gather_all(params: list[DistributedParameter]) -> dict[int, torch.Tensor]:
    """Full tensors of `params` by id, one all-gather per dtype and group of ranks
    (tensor-parallel slices gather over their data-parallel group). Collective."""
    by_key: dict = {}
    for p in params:
        ranks = group_of(p)
        key = (
            p.dtype,
            p.device,
            id(ranks.group),
            ranks.grad_scale,
            getattr(p, "reduce_dtype", None),
        )
        by_key.setdefault(key, (ranks, []))[1].append(p)
    out = {}
    for ranks, group in by_key.values():
        out.update(zip(map(id, group), _GatherMany.apply(ranks, *group)))
    return out


# The modules whose parameters the root's forward holds whole, while it runs.
_ROOT_SHADOWED: weakref.WeakSet = weakref.WeakSet()


class LooseParams:
    """A model's DistributedParameters outside blocks, gathered once per root forward.

    The root's forward gathers them all (one collective per dtype) into `gathered`;
    each module that owns some reads its full tensors from there during its own
    forward (`module_pre_forward`) instead of gathering them one by one.
    """

    def __init__(self, params: list[DistributedParameter], first_blocks=()):
        self.params = params
        self.first_blocks = list(first_blocks)
        self.gathered: dict[int, torch.Tensor] = {}  # id(param) -> full tensor

    def root_pre_forward(self, module, args) -> None:
        # The first block's all-gather is issued first, so it runs under this
        # gather and the embedding's compute instead of after them.
        for block in self.first_blocks:
            block.prefetch()
        # A Block built around this model later (a wrapped layer inside a
        # CheckpointBlock) took some of them into its flat buffer, which gathers them.
        self.params = [p for p in self.params if not getattr(p, "_in_block", False)]
        self.gathered.update(gather_all(self.params))
        # The root's own forward reads them whole too, as BMTrain's does: a head tied
        # to the embedding (`F.linear(h, self.emb.weight)`) sees the full matrix.
        for owner in module.modules():
            if self._shadow(owner):
                _ROOT_SHADOWED.add(owner)

    def root_post_forward(self, module, args, output) -> None:
        self.gathered.clear()
        for owner in module.modules():
            if owner in _ROOT_SHADOWED:
                _ROOT_SHADOWED.discard(owner)
                LooseParams.module_post_forward(owner, args, output)

    def _shadow(self, module) -> bool:
        """Shadows `module`'s gathered parameters with their full tensors; whether it
        has any."""
        shadowed = False
        for name, param in module._parameters.items():
            full = self.gathered.get(id(param)) if isinstance(param, DistributedParameter) else None
            if full is not None:
                module.__dict__[name] = full
                shadowed = True
        return shadowed

    def module_pre_forward(self, module, args) -> None:
        for name, param in module._parameters.items():
            if isinstance(param, DistributedParameter):
                full = self.gathered.get(id(param))
                # Shadows the Parameter for the length of this module's forward.
                module.__dict__[name] = param.gather() if full is None else full

    @staticmethod
    def module_post_forward(module, args, output) -> None:
        if module in _ROOT_SHADOWED:
            return  # whole until the root's forward ends (root_post_forward)
        for name, param in module._parameters.items():
            if isinstance(param, DistributedParameter):
                module.__dict__.pop(name, None)
