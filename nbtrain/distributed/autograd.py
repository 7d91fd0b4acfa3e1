"""Every differentiable collective of nbtrain, each defined once: the autograd Functions
that BMTrain's `bmt.distributed`, the tensor-parallel steps (nbtrain.tensor_parallel.comm) and the
expert-parallel token exchange (nbtrain.moe.dispatch) call with their own shapes.

The shape is an argument: `dim` names where the ranks' parts meet (None: stacked on a
new first dimension, BMTrain's `all_gather`; 0: one after another along the rows,
sequence parallel; -1: side by side in the columns). So is the gradient a gather
gives, since two conventions meet here (`Grad`):

- `Grad.SAME`: every rank computes the same loss from the gathered result, counted
  once; the gradient of this rank's input is its own part of the output's gradient.
- `Grad.EACH`: each rank's loss counts; the gradient of the input is the sum of every
  rank's gradient of its part (a reduce-scatter).

`Ranks` names the ranks a collective runs over and how its traffic is counted: the
kind (`CommKind.TP_*` for tensor parallelism) and the label ("tp gather input", or
"distributed all_gather" where a caller gives none). Everything travels through
nbtrain's counted collectives (nbtrain.comm.collectives). Over `ALONE` each collective
copies and counts nothing; callers that skip a one-rank group do so before calling.

Collective: every rank of the group calls each function in the same order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..comm import collectives as C
from ..comm.accounting import CommKind
from ..comm.topology import ALONE


class Grad(enum.Enum):
    """The gradient of a gather (see the module's notes)."""

    SAME = "same"  # every rank's loss is the same: this rank's part of the gradient
    EACH = "each"  # each rank's loss counts: the parts' gradients summed over the ranks


@dataclass(frozen=True)
class Ranks:
    """The ranks a collective runs over, and how its traffic is counted.

    Attributes:
        group: a torch process group, None (the world) or `ALONE` (this rank alone).
        size: the ranks in `group`; rank: this rank's place among them.
        tp: counted as tensor-parallel traffic (CommKind.TP_ALL_GATHER, ...).
        prefix: the label of a collective given none: "{prefix} {kind}", as
            "distributed all_gather".
    """

    group: object
    size: int = 1
    rank: int = 0
    tp: bool = False
    prefix: str = "distributed"

    def kind(self, op: CommKind) -> CommKind:
        return CommKind[f"TP_{op.name}"] if self.tp else op

    def label(self, op: CommKind, label: str | None) -> str:
        return label or f"{self.prefix} {op.value}"


# -- the collectives, without autograd ------------------------------------------------


def gather(x: torch.Tensor, ranks: Ranks, dim: int | None = None, label=None) -> torch.Tensor:
    """Every rank's `x`, in rank order: stacked, `(size, *x.shape)` (dim None), or
    concatenated along `dim`."""
    x = x.detach().contiguous()
    out = torch.empty((ranks.size, *x.shape), dtype=x.dtype, device=x.device)
    op = CommKind.ALL_GATHER
    C.all_gather(
        out.view(-1),
        x.reshape(-1),
        group=ranks.group,
        label=ranks.label(op, label),
        kind=ranks.kind(op),
    )
    if dim is None:
        return out
    return out.flatten(0, 1) if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def own_part(x: torch.Tensor, ranks: Ranks, dim: int) -> torch.Tensor:
    """This rank's part of `x` cut in `ranks.size` along `dim` (no communication)."""
    return x.chunk(ranks.size, dim=dim)[ranks.rank].contiguous()


def all_reduce(x: torch.Tensor, op: str, ranks: Ranks, label=None) -> torch.Tensor:
    """`x` reduced over the ranks (a new tensor). op: "sum", "avg" (an integer average
    truncates), "max", "min" or "prod" (gathered and multiplied here)."""
    if op == "prod":
        return gather(x, ranks).prod(0, dtype=x.dtype)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    kind = CommKind.ALL_REDUCE
    C.all_reduce(
        out,
        op="sum" if op == "avg" else op,
        group=ranks.group,
        label=ranks.label(kind, label),
        kind=ranks.kind(kind),
    )
    if op == "avg":
        if out.is_floating_point() or out.is_complex():
            out.div_(ranks.size)
        else:
            out.div_(ranks.size, rounding_mode="trunc")
    return out


def reduce_scatter(x: torch.Tensor, op: str, ranks: Ranks, label=None) -> torch.Tensor:
    """`x` reduced over the ranks, this rank keeping its rows: `(x.shape[0] // size,
    *x.shape[1:])`, rank r holding rows `r*n:(r+1)*n`. The caller checks that the
    first dimension divides."""
    rows = x.shape[0] // ranks.size
    if op not in ("sum", "avg"):
        return all_reduce(x, op, ranks)[ranks.rank * rows : (ranks.rank + 1) * rows].clone()
    x = x.detach().contiguous()
    exact = x.is_floating_point() or x.is_complex()
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    kind = CommKind.REDUCE_SCATTER
    C.reduce_scatter(
        out.view(-1),
        x.view(-1),
        op=op if exact else "sum",
        group=ranks.group,
        label=ranks.label(kind, label),
        kind=ranks.kind(kind),
    )
    if op == "avg" and not exact:  # an integer average truncates, as in all_reduce
        out.div_(ranks.size, rounding_mode="trunc")
    return out


def broadcast(x: torch.Tensor, src: int, ranks: Ranks, label=None) -> torch.Tensor:
    """A copy of global rank `src`'s `x` on every rank."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if ranks.group is not ALONE and ranks.size > 1:
        label = ranks.label(CommKind.BROADCAST, label)
        C.broadcast(out, src=src, group=ranks.group, label=label)
    return out


def all_to_all(rows, out_splits, in_splits, ranks: Ranks, label: str) -> torch.Tensor:
    """Rows of uneven sizes: `in_splits[j]` rows to rank j, `out_splits[j]` from it."""
    out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
    C.all_to_all_single(
        out, rows.contiguous(), out_splits, in_splits, group=ranks.group, label=label
    )
    return out


# -- autograd -----------------------------------------------------------------------------


class Gather(torch.autograd.Function):
    """`Gather.apply(x, ranks, dim, grad, label, grad_label)`: `gather(x, ranks, dim)`.
    Gradient (`grad`): this rank's part (`Grad.SAME`), or the reduce-scatter of the
    gradient (`Grad.EACH`, dim 0 only), labelled `grad_label`."""

    @staticmethod
    def forward(ctx, x, ranks, dim, grad, label, grad_label):
        if grad is Grad.EACH and dim != 0:
            raise ValueError("Gather with Grad.EACH concatenates along dim 0 only")
        ctx.args = ranks, dim, grad, grad_label
        return gather(x, ranks, dim, label)

    @staticmethod
    def backward(ctx, g):
        ranks, dim, grad, grad_label = ctx.args
        if grad is Grad.EACH:
            dx = reduce_scatter(g, "sum", ranks, grad_label)
        else:
            dx = g[ranks.rank] if dim is None else own_part(g, ranks, dim)
        return dx, None, None, None, None, None


class Split(torch.autograd.Function):
    """`Split.apply(x, ranks, dim, zeros_elsewhere, grad_label)`: this rank's part of a
    replicated `x` along `dim`. Gradient: every rank's part gathered along `dim`, or,
    where `x` came from a `Gather` with `Grad.EACH` (whose gradient sums the ranks'),
    this rank's part with zeros elsewhere (no communication)."""

    @staticmethod
    def forward(ctx, x, ranks, dim, zeros_elsewhere, grad_label):
        ctx.args = ranks, dim, zeros_elsewhere, grad_label
        return own_part(x, ranks, dim)

    @staticmethod
    def backward(ctx, g):
        ranks, dim, zeros_elsewhere, grad_label = ctx.args
        if not zeros_elsewhere:
            return gather(g.contiguous(), ranks, dim, grad_label), None, None, None, None
        width = g.shape[dim]
        shape = list(g.shape)
        shape[dim] = width * ranks.size
        full = g.new_zeros(shape)
        full.narrow(dim, ranks.rank * width, width).copy_(g)
        return full, None, None, None, None


class AllReduce(torch.autograd.Function):
    """`AllReduce.apply(x, op, ranks, label)`: `all_reduce(x, op, ranks)`. Every rank
    computes the same loss from the result (`Grad.SAME`): the gradient is `grad` for a
    sum, `grad / size` for an average, `grad` where this rank held the max/min and 0
    elsewhere, `grad * result / x` for a product (no communication)."""

    @staticmethod
    def forward(ctx, x, op, ranks, label):
        out = all_reduce(x, op, ranks, label)
        ctx.op, ctx.size = op, ranks.size
        if op in ("max", "min"):
            ctx.save_for_backward(x != out)  # where this rank did not hold the result
        elif op == "prod":
            ctx.save_for_backward(out / x)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.op == "sum":
            return grad, None, None, None
        if ctx.op == "avg":
            return grad / ctx.size, None, None, None
        (saved,) = ctx.saved_tensors
        if ctx.op in ("max", "min"):
            return grad.masked_fill(saved, 0), None, None, None
        return grad * saved, None, None, None


class SumGrad(torch.autograd.Function):
    """`SumGrad.apply(x, ranks, grad_label)`: `x` unchanged (a replicated tensor that
    each rank uses for its own loss); its gradient is summed over the ranks."""

    @staticmethod
    def forward(ctx, x, ranks, grad_label):
        ctx.args = ranks, grad_label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ranks, grad_label = ctx.args
        return all_reduce(g, "sum", ranks, grad_label), None, None


class ReduceScatter(torch.autograd.Function):
    """`ReduceScatter.apply(x, op, ranks, label, grad_label)`: `reduce_scatter(x, op,
    ranks)`; each rank's loss counts: the gradient is the gather of the ranks' output
    gradients along dim 0 (divided by the ranks for "avg"; other ops have none)."""

    @staticmethod
    def forward(ctx, x, op, ranks, label, grad_label):
        ctx.args = op, ranks, grad_label
        return reduce_scatter(x, op, ranks, label)

    @staticmethod
    def backward(ctx, grad):
        op, ranks, grad_label = ctx.args
        if op not in ("sum", "avg"):
            raise NotImplementedError(
                f"reduce_scatter(op={op!r}) has no gradient (nor in BMTrain); use op='sum' or 'avg'"
            )
        full = gather(grad, ranks, 0, grad_label)
        if op == "avg":
            full = full / ranks.size
        return full, None, None, None, None


class Broadcast(torch.autograd.Function):
    """`Broadcast.apply(x, src, ranks, label, grad_label)`: global rank `src`'s `x` on
    every rank; the gradient is the sum of every rank's output gradient, on every rank."""

    @staticmethod
    def forward(ctx, x, src, ranks, label, grad_label):
        ctx.args = ranks, grad_label
        return broadcast(x, src, ranks, label)

    @staticmethod
    def backward(ctx, grad):
        ranks, grad_label = ctx.args
        return all_reduce(grad, "sum", ranks, grad_label), None, None, None, None


class AllToAll(torch.autograd.Function):
    """`AllToAll.apply(rows, out_splits, in_splits, ranks, label, grad_label)`: uneven
    rows to every rank (`all_to_all`); backward sends the gradients back the way the
    rows came."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, ranks, label, grad_label):
        ctx.args = out_splits, in_splits, ranks, grad_label
        return all_to_all(rows, out_splits, in_splits, ranks, label)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, ranks, grad_label = ctx.args
        grad_in = all_to_all(grad, in_splits, out_splits, ranks, grad_label)
        return grad_in, None, None, None, None, None
