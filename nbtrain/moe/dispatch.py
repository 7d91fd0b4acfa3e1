"""Moving token rows between the ranks of an expert-parallel (ep) group.

`all_to_all_rows` is the differentiable uneven all_to_all the layer's dispatch and
combine use (nbtrain.distributed.autograd's `AllToAll`, through
nbtrain.comm.collectives, so the byte counters see it);
`ExpertParallel` is the layout a caller gives a layer (`ExpertParallel.from_topology()`
for the ep group of `init_distributed(ep_size=...)`), and `_ep_group` resolves a layer's
`group=` argument (None: every expert local, whatever the topology).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import collectives, context
from ..comm.topology import ALONE
from ..distributed import autograd as A
from .experts import experts_ffn


def all_to_all_rows(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None, label: str = "moe"
) -> torch.Tensor:
    """Differentiable uneven all_to_all of (sum(in_splits), ...) rows ->
    (sum(out_splits), ...). Collective over `group`."""
    ranks = A.Ranks(group)
    grad_label = label + " backward"
    return A.AllToAll.apply(rows, list(out_splits), list(in_splits), ranks, label, grad_label)


@dataclass(frozen=True)
class Chunk:
    """One slice of a layer's routed rows on its way through the experts' ranks.

    in_splits: rows this rank sends to each ep rank (its chunk's rows, grouped by expert);
    out_splits: rows it receives from each; counts: (ep, local experts) received rows by
    source rank and local expert, the order they arrive in."""

    in_splits: list
    out_splits: list
    counts: torch.Tensor


def _experts_on(received, w_in, w_out, counts):
    """Runs the local experts on rows arriving by source rank, each source's grouped by
    local expert: regroups them by expert, computes, puts the results back in order."""
    local = counts.shape[1]
    local_of = torch.repeat_interleave(
        torch.arange(local, device=received.device).repeat(counts.shape[0]), counts.reshape(-1)
    )
    by_expert = torch.argsort(local_of, stable=True)
    per_expert = torch.bincount(local_of, minlength=local).tolist()
    outs = experts_ffn(received[by_expert], w_in, w_out, per_expert)
    return torch.empty_like(received).index_copy(0, by_expert, outs)


def _post(rows, chunk: Chunk, group, label: str, outward: bool):
    """Posts one chunk's rows to its experts' ranks (`outward`) or back from them:
    (the receive buffer, the handle to wait on)."""
    out_splits, in_splits = (
        (chunk.out_splits, chunk.in_splits) if outward else (chunk.in_splits, chunk.out_splits)
    )
    buf = rows.new_empty((sum(out_splits), rows.shape[1]))
    handle = collectives.all_to_all_single(
        buf, rows.contiguous(), out_splits, in_splits, group=group, label=label, async_op=True
    )
    return buf, handle


class _ExpertsExchange(torch.autograd.Function):
    """Dispatch, the local experts and combine of a layer's chunks, pipelined: every
    chunk's dispatch is posted at once, each chunk's experts run as soon as its rows are
    in, and its combine is posted before the next chunk's experts run, so one chunk's
    exchange travels while another's experts compute (backward: the same, reversed).
    The experts' graph of each chunk is built inside forward and differentiated in
    backward (torch.autograd.grad), which hands back the rows' and weights' gradients."""

    @staticmethod
    def forward(ctx, rows, w_in, w_out, chunks, group, track):
        sends = rows.split([sum(c.in_splits) for c in chunks])
        posted = [_post(send, c, group, "moe dispatch", True) for send, c in zip(sends, chunks)]
        weights = [w.detach().requires_grad_(track and w.requires_grad) for w in (w_in, w_out)]
        graphs, back = [], []
        for c, (buf, handle) in zip(chunks, posted):
            handle.wait()
            with torch.enable_grad():
                x = buf.requires_grad_(track and rows.requires_grad)
                y = _experts_on(x, *weights, c.counts)
            graphs.append((x, y))
            back.append(_post(y.detach(), c, group, "moe combine", False))
        for _, handle in back:
            handle.wait()
        ctx.graphs, ctx.weights, ctx.chunks, ctx.group = graphs, weights, chunks, group
        return torch.cat([buf for buf, _ in back])

    @staticmethod
    def backward(ctx, grad):
        chunks, group = ctx.chunks, ctx.group
        grads = grad.split([sum(c.in_splits) for c in chunks])
        posted = [_post(g, c, group, "moe combine backward", True) for g, c in zip(grads, chunks)]
        wants = [w for w in ctx.weights if w.requires_grad]
        weight_grads = [None, None]
        back = []
        for (x, y), c, (buf, handle) in zip(ctx.graphs, chunks, posted):
            handle.wait()
            inputs = ([x] if x.requires_grad else []) + wants
            got = list(torch.autograd.grad(y, inputs, buf, allow_unused=True)) if inputs else []
            dx = got.pop(0) if x.requires_grad else None
            for i, w in enumerate(ctx.weights):
                if w.requires_grad:
                    g = got.pop(0)
                    g = torch.zeros_like(w) if g is None else g
                    weight_grads[i] = g if weight_grads[i] is None else weight_grads[i] + g
            if x.requires_grad:  # the same on every rank: every rank posts this exchange
                dx = torch.zeros_like(x) if dx is None else dx
                back.append(_post(dx, c, group, "moe dispatch backward", False))
        for _, handle in back:
            handle.wait()
        ctx.graphs = None
        rows_grad = torch.cat([buf for buf, _ in back]) if back else None
        return rows_grad, *weight_grads, None, None, None


def exchange_experts(rows, w_in, w_out, chunks: list, group) -> torch.Tensor:
    """The expert outputs of `rows` (this rank's routed rows: chunk by chunk, each chunk
    grouped by expert), in the same order: each chunk's rows sent to their experts' ranks,
    computed there, and sent back, the chunks pipelined (`_ExpertsExchange`).
    Differentiable in rows, w_in and w_out. Collective over the ep `group`. One chunk
    is the plain sequence (dispatch, experts, combine) under autograd, without the
    pipeline's nested backward."""
    if len(chunks) == 1:
        (c,) = chunks
        received = all_to_all_rows(rows, c.out_splits, c.in_splits, group, "moe dispatch")
        computed = _experts_on(received, w_in, w_out, c.counts)
        return all_to_all_rows(computed, c.in_splits, c.out_splits, group, "moe combine")
    return _ExpertsExchange.apply(rows, w_in, w_out, chunks, group, torch.is_grad_enabled())


@dataclass(frozen=True)
class ExpertParallel:
    """How a MoE layer (nbtrain.moe.MoE, MoEGPT's layers) splits its experts over the
    ranks of an ep group: given to the layer, never read from global state by it.

    Attributes:
        group: the ep process group (None: the whole world; `ALONE`: this rank alone,
            every expert local).
    """

    group: object = None

    @classmethod
    def from_topology(cls) -> "ExpertParallel | None":
        """The topology's ep group when nbtrain is initialised with ep_size > 1, else
        None. Read once, here: the caller hands the result to the layer or model."""
        if not context.is_initialized():
            return None
        topo = context.get_context().topology
        return cls(topo.group("ep")) if topo.ep_size > 1 else None


def _topology_ep():
    """The ep group of nbtrain's topology (None: the world), or False when nbtrain has
    made no context."""
    return context.get_context().topology.group("ep") if context.is_initialized() else False


def _warn_if_local_changed_meaning() -> None:
    """Until this release a layer built without a group followed the topology's ep group
    (the world without nbtrain's context): say so where that spanned more than one rank."""
    if context.is_initialized():
        old, where = context.get_context().topology.ep_size, "init_distributed(ep_size={})"
    else:
        old, where = dist.get_world_size(), "torch.distributed's world of {} ranks"
    if old > 1:
        warnings.warn(
            f"MoE built without an ep layout under {where.format(old)}: its experts "
            "are all local (no expert parallelism); before this release they were "
            "split over that group. Pass group= (MoEGPT: ep_group=) "
            "ExpertParallel.from_topology() to split them, or "
            "nbtrain.comm.topology.ALONE to keep them local without this warning",
            UserWarning,
            stacklevel=4,
        )


def _ep_group(group):
    """(group, size, rank) of a layer's `group=`: an `ExpertParallel`, a process group,
    `ALONE` or None (every expert local, whatever the topology). A one-rank group, or
    no process group at all, is ALONE."""
    if group is None:
        if dist.is_initialized():
            _warn_if_local_changed_meaning()
        return ALONE, 1, 0
    if isinstance(group, ExpertParallel):
        group = group.group  # None here: the world
    if group is ALONE or not dist.is_initialized():
        return ALONE, 1, 0
    size = dist.get_world_size(group)
    return (ALONE, 1, 0) if size == 1 else (group, size, dist.get_rank(group))


def _is_topology_ep(group) -> bool:
    """Whether `group` is the ep group of nbtrain's topology: only then are the experts
    slices that state dicts gather and `wrap` shards (over the topology's edp group).
    Experts over another group stay this rank's own (local in state dicts)."""
    topology_ep = _topology_ep()
    return topology_ep is not False and group is topology_ep
