"""Tensor-parallel layers under BMTrain's names and flags (`bmt.nn`).

As BMTrain's layers read `config["tp_comm"]`, these split over the process's tp group
(`init_distributed(tp_size=...)`): building one, or applying a plan with
`nbtrain.parallelize`, is the caller's choice of tensor parallelism. nbtrain's models
never make that choice themselves: a `GPT(cfg)` is plain whatever tp_size is.

Each layer keeps its slice of the weight as a plain parameter placed as a
"tp_slice" (`nbtrain.zero.placement_of(param)`: the dimension it splits, 0 = rows,
1 = columns, and the full shape); replicated parameters (a row-parallel bias) are
placed "tp_replicated" (as BMTrain's tp-mode parameter without a split dimension:
sharded over data parallel only, counted once in a norm). Layouts between layers
(see nbtrain.tensor_parallel.comm):

=====================  ===================  =====================================
layer, flags           input                output
=====================  ===================  =====================================
ColumnParallelLinear   gather_input=True:   (all tokens, out/tp); gather_output=True:
                       token slice (seq.    (all tokens, out)
                       parallel, default);
                       False: all tokens
                       (Megatron)
RowParallelLinear      (all tokens, in/tp); all_reduce_output=False (default):
                       split_input=True:    token slice (seq. parallel);
                       token slice, whole   True: all tokens (Megatron)
                       `in` (gathered, this
                       rank takes its slice)
VPEmbedding            ids: token slice     embeddings of this rank's ids
                       (sequence_parallel=
                       True) or all tokens
VPEmbedding(x,         token slice          (all tokens, vocab/tp) logits, padded
  projection=True)     (sequence_parallel=  columns -inf: for FusedCrossEntropy(
                       True) or all tokens  parallel=True)
=====================  ===================  =====================================

"Token slice" is a slice of the FIRST dimension (the tokens of (tokens, hidden),
the batch of (batch, seq, hidden)); it must divide by tp_size. The weights start
as the plain layer's would (the full tensor is drawn with the same generator on
every rank, then sliced), so a tp run starts from the plain model's values.
`state_dict()` holds the full tensors under the plain layer's names (gathered over
tp, so every tp rank calls it) and `load_state_dict()` takes full tensors.
`async_gather_chunks` / `async_chunks` are accepted for BMTrain's signatures; the
chunked overlap of communication with the GEMMs is not done yet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.context import get_context
from ..zero import is_slice, place, placement_of
from . import comm as tp_comm
from .partial import note_layer
from .slices import cut, full_from_slice, pad_along, slice_from_full


def _tp() -> tuple[int, int]:
    topo = get_context().topology
    return topo.tp_size, topo.tp_rank


def slice_param(
    full: torch.Tensor, dim: int | None, size: int, rank: int, groups: int = 1
) -> nn.Parameter:
    """This rank's slice of `full` along `dim`. With `groups` > 1 the dimension is that
    many equal parts (q, k and v of a fused projection) and each part is split. With
    `dim` None the whole tensor, placed "tp_replicated": the layer makes its gradient
    whole on every tp rank, so ZeRO shards it over data parallel only
    (nbtrain.zero.placement)."""
    param = nn.Parameter(cut(full, dim, size, rank, groups).contiguous().clone())
    kind = "tp_replicated" if dim is None else "tp_slice"
    place(param, kind=kind, split_dim=dim, full_shape=tuple(full.shape), parts=groups)
    return param


class FullStateDict:
    """Mixin for a module whose parameters are slices (tp layers, nbtrain.moe's experts):
    state_dict() holds the full logical tensors under the plain layer's names (gathered
    over the slices' group: collective, every rank of it calls it); load_state_dict()
    takes full tensors and keeps this rank's slice. Call `_setup_full_state_dict()` in
    `__init__`, after the sliced parameters exist."""

    def _setup_full_state_dict(self) -> None:
        self._register_state_dict_hook(_gather_slices)
        self._register_load_state_dict_pre_hook(_slice_full, with_module=True)


class _MakesLayout:
    """Mixin for a tp layer whose flags say whether it takes or hands on token slices
    (`splits_tokens`): the layout the replicated parameters nobody declared take
    (nbtrain.tensor_parallel.partial.default_layout). Call `note_layer(self)` in
    `__init__`; a copy (copy.deepcopy, unpickling) is noted again here."""

    def splits_tokens(self) -> bool:
        raise NotImplementedError

    def __setstate__(self, state):
        super().__setstate__(state)
        note_layer(self)


class _LinearSlices(FullStateDict):
    """A tp linear layer's weight and bias: its slices of a plain nn.Linear's.
    `SPLIT` is (weight's split dimension, bias's: None when the bias is whole)."""

    SPLIT: tuple = (0, 0)

    def _build(self, in_features: int, out_features: int, bias: bool, dtype) -> None:
        """Takes this rank's slices of a plain nn.Linear drawn as the plain layer's."""
        self.in_features, self.out_features = in_features, out_features
        note_layer(self)
        device = get_context().device
        plain = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.take_slices(plain)
        self._setup_full_state_dict()

    def take_slices(self, linear: nn.Linear) -> None:
        size, rank = _tp()
        weight_dim, bias_dim = self.SPLIT
        self.weight = slice_param(linear.weight.data, weight_dim, size, rank)
        self.bias = (
            None if linear.bias is None else slice_param(linear.bias.data, bias_dim, size, rank)
        )


def _tp_params(module: nn.Module):
    return [(n, p) for n, p in module.named_parameters(recurse=False) if is_slice(p)]


def _local_shape(param) -> tuple:
    """The tp slice's shape (a DistributedParameter stores a ZeRO shard of it)."""
    return tuple(getattr(param, "full_shape", param.shape))


def _gather_slices(module, state_dict, prefix, local_metadata):
    for name, param in _tp_params(module):
        key = prefix + name
        if key not in state_dict:
            continue
        local = param.gather_copy() if hasattr(param, "gather_copy") else param.detach()
        state_dict[key] = full_from_slice(local, placement_of(param))
    return state_dict


def _slice_full(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name, param in _tp_params(module):
        key = prefix + name
        value = state_dict.get(key)
        if value is None:
            continue
        local = slice_from_full(value, placement_of(param), _local_shape(param))
        if local is None:
            errors.append(
                f"{key}: shape {tuple(value.shape)}, expected the full "
                f"{placement_of(param).full_shape} (or this rank's {_local_shape(param)})"
            )
            continue
        state_dict[key] = local


def _divides(what: str, n: int, size: int) -> None:
    if n % size:
        raise ValueError(
            f"{what}={n} must divide by tp_size {size}; choose a multiple of "
            f"{size} (or another tp_size)"
        )


class Linear(nn.Linear):
    """BMTrain's `bmt.nn.Linear(in_features, out_features, bias=True, dtype=None)`: an
    ordinary replicated linear layer on the context's device."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None):
        super().__init__(
            in_features, out_features, bias=bias, dtype=dtype, device=get_context().device
        )


class LayerNorm(_MakesLayout, nn.LayerNorm):
    """A layer norm for activations between tensor-parallel layers.

    Its weight and bias are replicated on every tp rank. In the sequence-parallel
    layout (the default) each rank normalises only its slice of the tokens, so each
    holds part of the gradient: `sequence_parallel=True` sums it over the tp ranks
    (every rank then holds the whole gradient, as a plain layer norm would). With
    activations replicated (Megatron), pass False: the gradients already agree.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype=None,
        *,
        sequence_parallel: bool = True,
    ):
        super().__init__(
            normalized_shape,
            eps=eps,
            elementwise_affine=elementwise_affine,
            bias=bias,
            device=get_context().device,
            dtype=dtype,
        )
        self.sequence_parallel = sequence_parallel
        note_layer(self)
        for p in self.parameters():  # summed here, or whole already: never summed again
            place(p, tp_grad="whole")

    def splits_tokens(self) -> bool:
        return self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight = None if weight is None else tp_comm.sum_grad_over_tp(weight)
            bias = None if bias is None else tp_comm.sum_grad_over_tp(bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class ColumnParallelLinear(_MakesLayout, _LinearSlices, nn.Module):
    """y = x W^T + b with W split by rows (output features) over the tp ranks."""

    SPLIT = (0, 0)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype=None,
        gather_output: bool = False,
        gather_input: bool = True,
        async_gather_chunks: int = 2,
    ):
        super().__init__()
        _divides("ColumnParallelLinear out_features", out_features, _tp()[0])
        self.gather_output, self.gather_input = gather_output, gather_input
        self.async_gather_chunks = async_gather_chunks
        self._build(in_features, out_features, bias, dtype)

    def splits_tokens(self) -> bool:
        return self.gather_input  # its input is a token slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_comm.gather_rows(x) if self.gather_input else tp_comm.copy_to_tp(x)
        y = F.linear(x, self.weight, self.bias)
        return tp_comm.gather_last(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
            f"gather_input={self.gather_input}, gather_output={self.gather_output}"
        )


class RowParallelLinear(_MakesLayout, _LinearSlices, nn.Module):
    """y = x W^T + b with W split by columns (input features) over the tp ranks; the
    partial sums are reduce-scattered over tokens (default) or all-reduced."""

    SPLIT = (1, None)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype=None,
        split_input: bool = False,
        all_reduce_output: bool = False,
        async_chunks: int = 2,
    ):
        super().__init__()
        _divides("RowParallelLinear in_features", in_features, _tp()[0])
        self.split_input, self.all_reduce_output = split_input, all_reduce_output
        self.async_chunks = async_chunks
        self._build(in_features, out_features, bias, dtype)

    def splits_tokens(self) -> bool:
        return not self.all_reduce_output  # its output is a token slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            # BMTrain's split_input: a token slice with every input feature; all
            # tokens are gathered and this rank multiplies its features' columns.
            x = tp_comm.own_chunk_last(tp_comm.gather_rows(x), after_gather_rows=True)
        partial = F.linear(x, self.weight)
        if self.all_reduce_output:
            y = tp_comm.reduce_to_tp(partial)
            return y if self.bias is None else y + self.bias
        y = tp_comm.reduce_scatter_rows(partial)
        # The bias meets only this rank's tokens: sum its gradient over tp.
        return y if self.bias is None else y + tp_comm.sum_grad_over_tp(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"split_input={self.split_input}, all_reduce_output={self.all_reduce_output}"
        )


class VPEmbedding(_MakesLayout, FullStateDict, nn.Module):
    """Vocabulary-parallel embedding; `forward(x, projection=True)` is the tied output
    projection, giving vocabulary-sharded logits.

    A vocabulary that tp_size does not divide is padded to the next multiple; the
    padding rows are never looked up and their logits are -inf.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        dtype=torch.float32,
        init_mean: float = 0.0,
        init_std: float = 1.0,
        *,
        sequence_parallel: bool = True,
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        note_layer(self)
        # The entry of a sequence-parallel model made by `parallelize`: it is given
        # every token's id (the model's input) and returns its own tokens' rows.
        self.ids_whole = False
        size, rank = _tp()
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.padded_vocab = math.ceil(vocab_size / size) * size
        self.per_rank = self.padded_vocab // size
        self.start = rank * self.per_rank
        full = torch.empty(vocab_size, embedding_size, dtype=dtype, device=get_context().device)
        nn.init.normal_(full, mean=init_mean, std=init_std)
        self.weight = slice_param(pad_along(full, 0, self.padded_vocab), 0, size, rank)
        place(self.weight, full_shape=(vocab_size, embedding_size))  # the padding is not state
        self._setup_full_state_dict()

    def splits_tokens(self) -> bool:
        return self.sequence_parallel

    def forward(
        self, x: torch.Tensor, projection: bool = False, *, sequence_parallel: bool | None = None
    ) -> torch.Tensor:
        """Embeddings of the ids `x`, or with `projection=True` the logits of the
        hidden states `x` over this rank's vocabulary columns.

        sequence_parallel=True (BMTrain's layout): `x` is this tp rank's token slice,
        each rank gets its own tokens' embeddings, and the projection gathers the
        tokens (logits for all tokens). False (Megatron): `x` is the same on every tp
        rank, and so is the result. None: the layer's own setting (constructor).
        """
        if sequence_parallel is None:
            sequence_parallel = self.sequence_parallel
        if projection:
            return self._project(x, sequence_parallel)
        return self._embed(x, sequence_parallel)

    def _embed(self, ids: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        # Each rank looks the ids up in its own rows (zeros for the others' rows); the
        # sum over tp completes them. With token slices, every rank first gathers all
        # ids and the reduce-scatter hands each rank its own tokens' rows.
        ids = ids.to(self.weight.device)
        if sequence_parallel and not self.ids_whole:
            ids = tp_comm._gather_rows(ids, "tp gather ids")
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        rows = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        if sequence_parallel:
            return tp_comm.reduce_scatter_rows(rows)
        return tp_comm.reduce_to_tp(rows)

    def _project(
        self, x: torch.Tensor, sequence_parallel: bool, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = tp_comm.gather_rows(x) if sequence_parallel else tp_comm.copy_to_tp(x)
        logits = F.linear(x, self.weight if weight is None else weight)
        valid = self.vocab_size - self.start
        if valid < self.per_rank:  # this rank holds padding columns
            mask = torch.arange(self.per_rank, device=logits.device) >= valid
            logits = logits.masked_fill(mask, float("-inf"))
        return logits

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size} (rows {self.start}.."
            f"{self.start + self.per_rank - 1} here), embedding_size={self.embedding_size}"
        )


def declare_tp_gradients(module, partial: bool, overwrite: bool = False) -> int:
    """Declares how the replicated parameters of `module` get their gradients in a
    tensor-parallel model: `partial=True` where each tp rank computes with its own
    slice of the tokens (sequence parallel: the gradients are summed over tp), False
    where every tp rank sees every token (Megatron's layout: averaged). Slices are
    never partial and are left alone, and so are parameters already declared (a
    layer that sums its own gradient, nbtrain.nn.LayerNorm) unless `overwrite`.
    Checked at the first backward (nbtrain.tensor_parallel.partial); undeclared
    parameters take the layout the model's tp layers make. Returns how many it
    declared. Local."""
    value = "partial" if partial else "whole"
    count = 0
    for p in module.parameters():
        placed = placement_of(p)
        if placed.kind != "replicated" or (placed.tp_grad is not None and not overwrite):
            continue
        place(p, tp_grad=value)
        count += 1
    return count
