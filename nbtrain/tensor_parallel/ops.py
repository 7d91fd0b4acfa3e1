"""BMTrain's linear autograd functions (`bmt.nn.OpLinear`, `bmt.nn.OpParallelLinear`).

    y = OpLinear.apply(x, weight, bias)                       # F.linear(x, weight, bias)
    y = OpParallelLinear.apply(x, w_slice, b_slice, True, False, False, None)

OpParallelLinear runs one tensor-parallel linear layer over the tp group of
`init_distributed(tp_size=...)`, with the communication steps of nbtrain.tensor_parallel.comm
(counted, labelled "tp ..."). Its flags are BMTrain's (see `OpParallelLinear`).
nbtrain's own layers (nbtrain.tensor_parallel.layers) compose tp_comm's steps directly; these
functions are for code written against BMTrain's.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from . import comm as tp_comm


class OpLinear(torch.autograd.Function):
    """`OpLinear.apply(x, weight, bias=None)` equals `F.linear(x, weight, bias)`, with
    the backward written out (x: (..., in), weight: (out, in), bias: (out,) or None).
    Saves x and weight for backward, as F.linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = (*ctx.needs_input_grad, False)[:3]  # bias may be left out
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out.matmul(weight) if need_x else None
        grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = rows.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


class ReduceType(enum.Enum):
    """How OpParallelLinear combines the ranks' partial outputs (BMTrain's values)."""

    ALL_REDUCE = 1  # summed on every tp rank
    REDUCE_SCATTER = 2  # summed, each tp rank keeping its rows


def _prepare_input(x, gather_input: bool, split_input: bool):
    """The input the local GEMM reads: all tokens (gathered over tp along dim 0)
    and/or this rank's columns of the last dimension."""
    if gather_input:
        x = tp_comm._gather_rows(x, "tp gather input")
    if split_input:
        x = tp_comm._own_chunk_last(x)
    return x


class OpParallelLinear(torch.autograd.Function):
    """One tensor-parallel linear layer over the tp group (BMTrain's arguments).

    `OpParallelLinear.apply(x, weight, bias=None, gather_input=False,
    gather_output=False, split_input=False, reduce_output_type=None,
    async_gather_chunks=2)`, where weight and bias are this tp rank's slices:

    - gather_input: `x` is this rank's slice of the tokens (dim 0); the GEMM reads
      all of them, gathered over tp. Gradient: reduce-scattered back to the slices.
    - split_input: `x` is whole; the GEMM reads this rank's chunk of its last
      dimension (a row-parallel layer). Gradient: the ranks' chunks put side by side.
    - neither: `x` is whole and every rank reads all of it (a column-parallel
      layer, Megatron style). Gradient: summed over tp when the output is not
      reduced (each rank's weight slice contributes a part).
    - gather_output: the ranks' output columns put side by side on every rank.
      Gradient: this rank's columns.
    - reduce_output_type: None, `ReduceType.ALL_REDUCE` (1: the partial outputs
      summed on every rank; gradient unchanged) or `ReduceType.REDUCE_SCATTER` (2:
      summed, each rank keeping its slice of dim 0; gradient gathered).
    - async_gather_chunks: accepted for BMTrain's signature. BMTrain splits the
      gather and the reduce-scatter into chunks on a second CUDA stream to overlap
      them with the GEMMs; nbtrain runs each collective whole (the result is the
      same), on CPU and CUDA alike.

    As in BMTrain, the bias is added to each rank's partial output before any
    reduction (RowParallelLinear-style callers pass bias=None and add it after).
    `x` is saved, not its gathered form: backward gathers it again, as
    BMTrain does, so a layer keeps only its slice of the activations.

    Where BMTrain's gradient is wrong it is not copied: with split_input BMTrain
    returns a (tp, tokens, in/tp) gradient for an input of (tokens, in); this
    returns the shape of `x`.

    Collective over the tp group (a no-op at tp_size 1).
    """

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias=None,
        gather_input=False,
        gather_output=False,
        split_input=False,
        reduce_output_type=None,
        async_gather_chunks=2,
    ):
        reduce = None if reduce_output_type is None else ReduceType(reduce_output_type)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.flags = (bool(gather_input), bool(gather_output), bool(split_input), reduce)
        out = F.linear(_prepare_input(x, gather_input, split_input), weight, bias)
        if gather_output:
            out = tp_comm._gather_last(out, "tp gather output")
        if reduce is ReduceType.ALL_REDUCE:
            out = tp_comm._all_reduce(out, "tp all-reduce output")
        elif reduce is ReduceType.REDUCE_SCATTER:
            out = tp_comm._reduce_scatter_rows(out, "tp reduce-scatter output")
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gather_input, gather_output, split_input, reduce = ctx.flags
        need_x, need_w, need_b = (*ctx.needs_input_grad, False, False)[:3]
        grad = grad.contiguous()
        if reduce is ReduceType.REDUCE_SCATTER:
            grad = tp_comm._gather_rows(grad, "tp gather output grad")
        if gather_output:
            grad = tp_comm._own_chunk_last(grad)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = grad.matmul(weight)  # the gradient of the GEMM's x
            if split_input:
                if gather_input:  # zeros outside this rank's columns; summed below
                    _, size, rank = tp_comm.tp_group()
                    width = grad_x.shape[-1]
                    full = grad_x.new_zeros((*grad_x.shape[:-1], width * size))
                    full[..., rank * width : (rank + 1) * width] = grad_x
                    grad_x = full
                else:
                    grad_x = tp_comm._gather_last(grad_x.contiguous(), "tp gather x grad")
            if gather_input:
                grad_x = tp_comm._reduce_scatter_rows(grad_x, "tp reduce-scatter x grad")
            elif reduce is None and not split_input:
                grad_x = tp_comm._all_reduce(grad_x, "tp all-reduce x grad")
        if need_w:
            seen = _prepare_input(x, gather_input, split_input)
            grad_w = rows.t().matmul(seen.reshape(-1, seen.shape[-1]))
        if ctx.has_bias and need_b:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None
