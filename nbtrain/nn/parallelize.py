"""`parallelize(model, plan)`: tensor-parallelise a plain model in place.

    nbtrain.init_distributed(tp_size=2)
    model = GPT(cfg)                       # every rank builds the same plain model
    nbtrain.parallelize(model, GPT_PLAN)   # its layers now hold their tp slices

The plan maps module-name patterns (fnmatch: `*` matches dots too) to a style:

    "colwise"   nn.Linear -> ColumnParallelLinear (output features split)
    "rowwise"   nn.Linear -> RowParallelLinear (input features split, output all-reduced)
    "vocab"     nn.Embedding -> VPEmbedding (vocabulary rows split)
    "tied_head" nn.Linear whose weight is a "vocab" embedding's -> that embedding's
                projection, logits gathered to full width (the model's loss is unchanged)
    "head"      nn.Linear -> ColumnParallelLinear whose output is gathered to full width
                (an untied output projection)
    a callable  (module, name) -> the module to put in its place

Layouts are Megatron's (activations replicated on every tp rank); the weights are
the model's own, sliced, so the parallelised model computes what the plain one did,
and its state_dict (full tensors, plain names) loads into the plain model.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from . import tp_comm
from ..comm.context import get_context
from .parallel import (ColumnParallelLinear, RowParallelLinear, VPEmbedding, _FullStateDict,
                       _slice_param, _tp, pad_along)


def _quietly(make):
    """Build a layer without drawing from the RNG (its weights are replaced anyway)."""
    device = get_context().device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return make()


def _from_linear(cls, linear: nn.Linear, **flags):
    """A `cls` (a tp linear layer) holding this rank's slices of `linear`'s weights."""
    layer = _quietly(lambda: cls(linear.in_features, linear.out_features,
                                 bias=linear.bias is not None, dtype=linear.weight.dtype,
                                 **flags))
    layer.take_slices(linear)
    return layer.to(linear.weight.device)


def column_from(linear: nn.Linear, **flags) -> ColumnParallelLinear:
    return _from_linear(ColumnParallelLinear, linear, **flags)


def row_from(linear: nn.Linear, **flags) -> RowParallelLinear:
    return _from_linear(RowParallelLinear, linear, **flags)


def vocab_from(embedding: nn.Embedding, sequence_parallel: bool = False) -> VPEmbedding:
    size, rank = _tp()
    vocab, dim = embedding.weight.shape
    layer = _quietly(lambda: VPEmbedding(vocab, dim, dtype=embedding.weight.dtype,
                                         sequence_parallel=sequence_parallel))
    layer.weight = _slice_param(pad_along(embedding.weight.data, 0, layer.padded_vocab), 0,
                                size, rank)
    layer.weight.tp_full_shape = (vocab, dim)
    return layer.to(embedding.weight.device)


class TiedProjection(_FullStateDict, nn.Module):
    """The output projection of a vocabulary-parallel embedding, as an nn.Linear with
    that embedding's weight would be: full-width logits (gathered over tp)."""

    def __init__(self, embedding: VPEmbedding):
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # not a submodule: no new names
        self.weight = embedding.weight
        self._setup_full_state_dict()

    def forward(self, x):
        logits = self._embedding(x, projection=True, sequence_parallel=False)
        return tp_comm.gather_last(logits)[..., :self._embedding.vocab_size]


STYLES = ("colwise", "rowwise", "vocab", "tied_head", "head")


def parallelize(model: nn.Module, plan: dict) -> nn.Module:
    """Replace the modules that `plan` names by their tensor-parallel versions, in place.

    Collective in spirit: every tp rank calls it on the same plain model. Returns
    `model`, moved to the rank's device. Raises ValueError for a style that does not
    exist or does not fit the module, and for a pattern that matches nothing (a typo
    would otherwise leave a layer whole).

    At tp_size 1 the layers are replaced too (each holds a slice of size one and
    communicates nothing), so a model has the same structure, parameter for
    parameter, at every tp size: sharded checkpoints move between tp sizes.
    """
    unused = set(plan)
    embeddings: dict[int, VPEmbedding] = {}
    # Embeddings first, so a tied head can find the vocabulary-parallel one.
    named = sorted(model.named_modules(), key=lambda nm: plan_style(plan, nm[0]) != "vocab")
    for name, module in named:
        if not name:
            continue
        pattern, style = _match(plan, name)
        if style is None:
            continue
        unused.discard(pattern)
        _set(model, name, _replace(module, name, style, embeddings))
    if unused:
        raise ValueError(f"parallelize: pattern(s) {sorted(unused)} matched no module; module "
                         f"names look like {[n for n, _ in list(model.named_modules())[1:4]]}")
    # On the rank's device, as wrap() does: NCCL's collectives need CUDA tensors.
    return model.to(get_context().device)


def plan_style(plan: dict, name: str):
    return _match(plan, name)[1]


def _match(plan: dict, name: str):
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return pattern, style
    return None, None


def _replace(module, name, style, embeddings):
    if callable(style):
        return style(module, name)
    if style not in STYLES:
        raise ValueError(f"parallelize: style {style!r} for {name}; use one of "
                         f"{', '.join(STYLES)} or a callable")
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"parallelize: {name} is a {type(module).__name__}, not an "
                             "nn.Embedding, so it cannot be 'vocab'")
        layer = vocab_from(module)
        embeddings[id(module.weight)] = layer
        return layer
    if not isinstance(module, nn.Linear):
        raise ValueError(f"parallelize: {name} is a {type(module).__name__}, not an nn.Linear, "
                         f"so it cannot be {style!r}")
    if style == "colwise":
        return column_from(module, gather_input=False)
    if style == "rowwise":
        return row_from(module, all_reduce_output=True)
    if style == "head":
        return column_from(module, gather_input=False, gather_output=True)
    embedding = embeddings.get(id(module.weight))
    if embedding is None:
        raise ValueError(f"parallelize: {name} is 'tied_head' but its weight is not the "
                         "weight of a module the plan makes 'vocab'")
    return TiedProjection(embedding)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
