"""The tensor-parallel communication steps, each an autograd Function over the tp group.

Two ways to lay activations out between tensor-parallel layers:

- sequence parallel (BMTrain's default): each tp rank holds a slice of the FIRST
  dimension (the tokens of a (tokens, hidden) tensor, or the batch of a
  (batch, seq, hidden) one). A column-parallel layer gathers it (`gather_rows`)
  and a row-parallel layer reduce-scatters its partial sums back (`reduce_scatter_rows`).
- Megatron: every tp rank holds the whole activation. A column-parallel layer's
  input passes unchanged (`copy_to_tp`: its gradient is summed over tp) and a
  row-parallel layer all-reduces its partial sums (`reduce_to_tp`).

All communication goes through nbtrain's counted collectives, labelled "tp ...".
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.context import get_context
from ..comm.topology import ALONE


def tp_group():
    """(group, size, rank) of this rank's tensor-parallel group."""
    topo = get_context().topology
    return topo.group("tp"), topo.tp_size, topo.tp_rank


def _gather_rows(x: torch.Tensor, label: str) -> torch.Tensor:
    group, size, _ = tp_group()
    if size == 1 or group is ALONE:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out.view(-1), x.view(-1), group=group, label=label)
    return out


def _reduce_scatter_rows(x: torch.Tensor, label: str) -> torch.Tensor:
    group, size, _ = tp_group()
    if size == 1 or group is ALONE:
        return x
    if x.shape[0] % size:
        raise ValueError(
            f"tensor parallel: the first dimension ({x.shape[0]}) must divide by "
            f"tp_size {size} to be split between the tp ranks"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter(out.view(-1), x.view(-1), op="sum", group=group, label=label)
    return out


def _all_reduce(x: torch.Tensor, label: str) -> torch.Tensor:
    group, size, _ = tp_group()
    if size == 1 or group is ALONE:
        return x
    x = x.contiguous().clone()
    C.all_reduce(x, op="sum", group=group, label=label)
    return x


def _gather_last(x: torch.Tensor, label: str) -> torch.Tensor:
    group, size, _ = tp_group()
    if size == 1 or group is ALONE:
        return x
    stacked = _gather_rows(x.unsqueeze(0), label)  # (size, *x.shape)
    return torch.cat(stacked.unbind(0), dim=-1)


def _own_chunk_last(x: torch.Tensor) -> torch.Tensor:
    _, size, rank = tp_group()
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(
            f"tensor parallel: the last dimension ({x.shape[-1]}) must divide by tp_size {size}"
        )
    return x.chunk(size, dim=-1)[rank].contiguous()


def _pair(name: str, forward, backward):
    """An autograd Function running `forward` on the input and `backward` on its gradient."""
    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda ctx, x: forward(x)),
            "backward": staticmethod(lambda ctx, grad: backward(grad)),
        },
    )


_GatherRows = _pair(
    "_GatherRows",
    lambda x: _gather_rows(x, "tp gather input"),
    lambda g: _reduce_scatter_rows(g, "tp reduce-scatter input grad"),
)
_ReduceScatterRows = _pair(
    "_ReduceScatterRows",
    lambda x: _reduce_scatter_rows(x, "tp reduce-scatter output"),
    lambda g: _gather_rows(g, "tp gather output grad"),
)
_CopyToTp = _pair("_CopyToTp", lambda x: x, lambda g: _all_reduce(g, "tp all-reduce input grad"))
_ReduceToTp = _pair("_ReduceToTp", lambda x: _all_reduce(x, "tp all-reduce output"), lambda g: g)
_GatherLast = _pair("_GatherLast", lambda x: _gather_last(x, "tp gather output"), _own_chunk_last)
# Identity whose gradient is summed over tp: a replicated parameter used on a token
# slice (sequence parallel) gets the gradient of all tokens on every rank.
_SumGradOverTp = _pair(
    "_SumGradOverTp",
    lambda p: p.view_as(p),
    lambda g: _all_reduce(g, "tp all-reduce replicated grad"),
)


class _OwnChunkLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pad_grad):
        ctx.pad_grad = pad_grad
        return _own_chunk_last(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.pad_grad:
            return _gather_last(grad.contiguous(), "tp gather input grad"), None
        # The input came from gather_rows, whose backward sums over tp: give it this
        # rank's columns and zeros elsewhere, so the sum assembles the whole row.
        _, size, rank = tp_group()
        full = grad.new_zeros((*grad.shape[:-1], grad.shape[-1] * size))
        full[..., rank * grad.shape[-1] : (rank + 1) * grad.shape[-1]] = grad
        return full, None


def gather_rows(x):
    """Sequence parallel -> all tokens: gather the first dimension (grad: reduce-scatter)."""
    return _GatherRows.apply(x)


def reduce_scatter_rows(x):
    """Partial sums of all tokens -> this rank's token slice, summed (grad: gather)."""
    return _ReduceScatterRows.apply(x)


def copy_to_tp(x):
    """A replicated activation entering a tp region (grad: all-reduce over tp)."""
    return _CopyToTp.apply(x)


def reduce_to_tp(x):
    """Partial sums -> their sum on every tp rank (grad: unchanged)."""
    return _ReduceToTp.apply(x)


def gather_last(x):
    """Column slices -> the whole last dimension (grad: this rank's slice)."""
    return _GatherLast.apply(x)


def own_chunk_last(x, after_gather_rows: bool = False):
    """The whole last dimension -> this rank's slice. Its gradient gathers the slices
    (a replicated input), or, right after `gather_rows`, is zero outside this rank's
    slice (the gather's backward sums the slices)."""
    return _OwnChunkLast.apply(x, after_gather_rows)


def sum_grad_over_tp(p):
    """`p` unchanged; its gradient is summed over the tp group."""
    return _SumGradOverTp.apply(p)
