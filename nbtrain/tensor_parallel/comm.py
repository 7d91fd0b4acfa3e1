"""The tensor-parallel communication steps, each differentiable, over the tp group.

Two ways to lay activations out between tensor-parallel layers:

- sequence parallel (BMTrain's default): each tp rank holds a slice of the FIRST
  dimension (the tokens of a (tokens, hidden) tensor, or the batch of a
  (batch, seq, hidden) one). A column-parallel layer gathers it (`gather_rows`)
  and a row-parallel layer reduce-scatters its partial sums back (`reduce_scatter_rows`).
- Megatron: every tp rank holds the whole activation. A column-parallel layer's
  input passes unchanged (`copy_to_tp`: its gradient is summed over tp) and a
  row-parallel layer all-reduces its partial sums (`reduce_to_tp`).

The autograd Functions are nbtrain.distributed.autograd's (one home for every
differentiable collective), over the tp group, counted as tensor-parallel traffic
(CommKind.TP_*) and labelled "tp ...". A tp group of one rank communicates nothing:
each step is then the identity.
"""

from __future__ import annotations

import torch

from ..comm.context import get_context
from ..comm.topology import ALONE
from ..distributed import autograd as A


def tp_group():
    """(group, size, rank) of this rank's tensor-parallel group."""
    topo = get_context().topology
    return topo.group("tp"), topo.tp_size, topo.tp_rank


def _tp_ranks() -> A.Ranks | None:
    """The tp group's ranks, counted as tensor-parallel traffic; None for one rank."""
    group, size, rank = tp_group()
    if size == 1 or group is ALONE:
        return None
    return A.Ranks(group, size, rank, tp=True, prefix="tp")


def _check_divides(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        which = "first" if dim == 0 else "last"
        tail = " to be split between the tp ranks" if dim == 0 else ""
        raise ValueError(
            f"tensor parallel: the {which} dimension ({x.shape[dim]}) must divide by "
            f"tp_size {size}{tail}"
        )


# -- the steps without autograd (BMTrain's OpParallelLinear composes them) -------------


def _gather_rows(x: torch.Tensor, label: str) -> torch.Tensor:
    ranks = _tp_ranks()
    return x if ranks is None else A.gather(x, ranks, 0, label)


def _reduce_scatter_rows(x: torch.Tensor, label: str) -> torch.Tensor:
    ranks = _tp_ranks()
    if ranks is None:
        return x
    _check_divides(x, 0, ranks.size)
    return A.reduce_scatter(x, "sum", ranks, label)


def _all_reduce(x: torch.Tensor, label: str) -> torch.Tensor:
    ranks = _tp_ranks()
    return x if ranks is None else A.all_reduce(x, "sum", ranks, label)


def _gather_last(x: torch.Tensor, label: str) -> torch.Tensor:
    ranks = _tp_ranks()
    return x if ranks is None else A.gather(x, ranks, -1, label)


def _own_chunk_last(x: torch.Tensor) -> torch.Tensor:
    _, size, rank = tp_group()
    if size == 1:
        return x
    _check_divides(x, -1, size)
    return A.own_part(x, A.Ranks(None, size, rank), -1)


# -- the differentiable steps ------------------------------------------------------------


def gather_rows(x):
    """Sequence parallel -> all tokens: gather the first dimension (grad: reduce-scatter)."""
    ranks = _tp_ranks()
    if ranks is None:
        return x.view_as(x)
    return A.Gather.apply(
        x, ranks, 0, A.Grad.EACH, "tp gather input", "tp reduce-scatter input grad"
    )


def reduce_scatter_rows(x):
    """Partial sums of all tokens -> this rank's token slice, summed (grad: gather)."""
    ranks = _tp_ranks()
    if ranks is None:
        return x.view_as(x)
    _check_divides(x, 0, ranks.size)
    return A.ReduceScatter.apply(
        x, "sum", ranks, "tp reduce-scatter output", "tp gather output grad"
    )


def copy_to_tp(x):
    """A replicated activation entering a tp region (grad: all-reduce over tp)."""
    ranks = _tp_ranks()
    return x.view_as(x) if ranks is None else A.SumGrad.apply(x, ranks, "tp all-reduce input grad")


def reduce_to_tp(x):
    """Partial sums -> their sum on every tp rank (grad: unchanged)."""
    ranks = _tp_ranks()
    return (
        x.view_as(x)
        if ranks is None
        else A.AllReduce.apply(x, "sum", ranks, "tp all-reduce output")
    )


def gather_last(x):
    """Column slices -> the whole last dimension (grad: this rank's slice)."""
    ranks = _tp_ranks()
    if ranks is None:
        return x.view_as(x)
    return A.Gather.apply(x, ranks, -1, A.Grad.SAME, "tp gather output", None)


def own_chunk_last(x, after_gather_rows: bool = False):
    """The whole last dimension -> this rank's slice. Its gradient gathers the slices
    (a replicated input), or, right after `gather_rows`, is zero outside this rank's
    slice (the gather's backward sums the slices)."""
    ranks = _tp_ranks()
    if ranks is None:
        return x.view_as(x)
    _check_divides(x, -1, ranks.size)
    return A.Split.apply(x, ranks, -1, after_gather_rows, "tp gather input grad")


def sum_grad_over_tp(p):
    """`p` unchanged; its gradient is summed over the tp group. A replicated parameter
    used on a token slice (sequence parallel) gets the gradient of all tokens on every
    rank."""
    ranks = _tp_ranks()
    if ranks is None:
        return p.view_as(p)
    return A.SumGrad.apply(p, ranks, "tp all-reduce replicated grad")
