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
    "replicated" nn.LayerNorm or nn.Embedding (position embeddings) kept whole on every
                tp rank; in the sequence-parallel layout its gradient is summed over tp
    a callable  (module, name) -> the module to put in its place

Two layouts of the activations between layers. Megatron's (the default): replicated
on every tp rank, an all-reduce after each row-parallel layer. Sequence parallel
(`sequence_parallel=True`, BMTrain's default): split along the first dimension (the
batch of a (batch, seq, hidden) activation, which tp must divide) between layers;
column-parallel layers gather it, row-parallel layers reduce-scatter, the "vocab"
embedding takes the model's whole input and returns this rank's rows, and the heads
gather all rows again, so `model(x)` still returns full logits. The weights are the
model's own, sliced, so the parallelised model computes what the plain one did, and
its state_dict (full tensors, plain names) loads into the plain model.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.context import get_context
from ..zero import place
from . import comm as tp_comm
from .layers import (
    ColumnParallelLinear,
    FullStateDict,
    LayerNorm,
    RowParallelLinear,
    VPEmbedding,
    _tp,
    declare_tp_gradients,
    pad_along,
    slice_param,
)


def without_rng(make):
    """Build a layer without drawing from the RNG (its weights are replaced anyway)."""
    device = get_context().device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return make()


def _from_linear(cls, linear: nn.Linear, **flags):
    """A `cls` (a tp linear layer) holding this rank's slices of `linear`'s weights."""
    layer = without_rng(
        lambda: cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            **flags,
        )
    )
    layer.take_slices(linear)
    return layer.to(linear.weight.device)


def column_from(linear: nn.Linear, **flags) -> ColumnParallelLinear:
    return _from_linear(ColumnParallelLinear, linear, **flags)


def row_from(linear: nn.Linear, **flags) -> RowParallelLinear:
    return _from_linear(RowParallelLinear, linear, **flags)


def vocab_from(embedding: nn.Embedding, sequence_parallel: bool = False) -> VPEmbedding:
    size, rank = _tp()
    vocab, dim = embedding.weight.shape
    layer = without_rng(
        lambda: VPEmbedding(
            vocab, dim, dtype=embedding.weight.dtype, sequence_parallel=sequence_parallel
        )
    )
    layer.weight = slice_param(
        pad_along(embedding.weight.data, 0, layer.padded_vocab), 0, size, rank
    )
    place(layer.weight, full_shape=(vocab, dim))  # the padding is not state
    layer.ids_whole = sequence_parallel  # the model hands it all ids
    return layer.to(embedding.weight.device)


class ReplicatedEmbedding(nn.Embedding):
    """An nn.Embedding (a position embedding) whose table every tp rank holds whole. In
    the sequence-parallel layout each rank adds it to its own rows only, so its gradient
    is summed over tp (as nbtrain.nn.LayerNorm's)."""

    sequence_parallel = False

    def forward(self, x):
        weight = tp_comm.sum_grad_over_tp(self.weight) if self.sequence_parallel else self.weight
        return F.embedding(
            x,
            weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )


def replicated_from(module: nn.Module, name: str, sequence_parallel: bool) -> nn.Module:
    """`module` (a layer norm or an embedding) as a layer kept whole on every tp rank."""
    if isinstance(module, nn.LayerNorm):
        layer = without_rng(
            lambda: LayerNorm(
                module.normalized_shape,
                eps=module.eps,
                elementwise_affine=module.elementwise_affine,
                bias=module.bias is not None,
                dtype=None if module.weight is None else module.weight.dtype,
                sequence_parallel=sequence_parallel,
            )
        )
        if module.weight is not None and module.weight.is_meta:  # no values to copy yet
            return layer.to("meta")
        layer.load_state_dict(module.state_dict())
        return layer.to(module.weight.device if module.weight is not None else None)
    if isinstance(module, nn.Embedding):
        module.__class__ = ReplicatedEmbedding  # same parameters, same names
        module.sequence_parallel = sequence_parallel
        place(module.weight, tp_grad="whole")  # summed over tp by the layer itself
        return module
    raise ValueError(
        f"parallelize: {name} is a {type(module).__name__}; 'replicated' takes "
        "an nn.LayerNorm or an nn.Embedding"
    )


class TiedProjection(FullStateDict, nn.Module):
    """The output projection of a vocabulary-parallel embedding, as an nn.Linear with
    that embedding's weight would be: full-width logits (gathered over tp)."""

    def __init__(self, embedding: VPEmbedding, sequence_parallel: bool = False):
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # not a submodule: no new names
        self.weight = embedding.weight
        self.sequence_parallel = sequence_parallel
        self._setup_full_state_dict()

    def forward(self, x):
        # This module's own `weight`, not the embedding's: where the two ends sit on
        # different pipeline stages, or wrap() shards it, only this one is the
        # parameter trained here (and, sharded, the gathered tensor of this forward).
        logits = self._embedding._project(x, self.sequence_parallel, weight=self.weight)
        return tp_comm.gather_last(logits)[..., : self._embedding.vocab_size]


STYLES = ("colwise", "rowwise", "vocab", "tied_head", "head", "replicated")


class Plan(dict):
    """A plan (pattern -> style) that knows its layout: `sequence_parallel`."""

    def __init__(self, styles: dict, sequence_parallel: bool = False):
        super().__init__(styles)
        self.sequence_parallel = sequence_parallel


def parallelize(model: nn.Module, plan: dict, sequence_parallel: bool | None = None) -> nn.Module:
    """Replace the modules that `plan` names by their tensor-parallel versions, in place.

    Collective in spirit: every tp rank calls it on the same plain model. Returns
    `model`, moved to the rank's device. Raises ValueError for a style that does not
    exist or does not fit the module, and for a pattern that matches nothing (a typo
    would otherwise leave a layer whole).

    At tp_size 1 the layers are replaced too (each holds a slice of size one and
    communicates nothing), so a model has the same structure, parameter for
    parameter, at every tp size: sharded checkpoints move between tp sizes.

    `sequence_parallel` picks the layout (see the module docstring); None takes the
    plan's (`Plan.sequence_parallel`, False for a plain dict).
    """
    planned = getattr(plan, "sequence_parallel", None)
    if sequence_parallel is None:
        sequence_parallel = bool(planned)
    elif planned is not None and planned != sequence_parallel:
        raise ValueError(
            f"parallelize: sequence_parallel={sequence_parallel}, but the plan "
            f"was made for sequence_parallel={planned} (its callables build "
            "layers for that layout): make the plan with the same setting"
        )
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
        _set(model, name, _replace(module, name, style, embeddings, sequence_parallel))
    if unused:
        raise ValueError(
            f"parallelize: pattern(s) {sorted(unused)} matched no module; module "
            f"names look like {[n for n, _ in list(model.named_modules())[1:4]]}"
        )
    # The layout is this plan's: every replicated parameter left sees this rank's
    # tokens only (sequence parallel) or every token (nbtrain.tensor_parallel.partial).
    declare_tp_gradients(model, partial=sequence_parallel)
    # On the rank's device, as wrap() does: NCCL's collectives need CUDA tensors. A model
    # built on the meta device stays there: wrap() allocates its shards on the device.
    if any(p.is_meta for p in model.parameters()):
        return model
    return model.to(get_context().device)


def plan_style(plan: dict, name: str):
    return _match(plan, name)[1]


def _match(plan: dict, name: str):
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return pattern, style
    return None, None


def _replace(module, name, style, embeddings, sp: bool):
    if callable(style):
        return style(module, name)
    if style not in STYLES:
        raise ValueError(
            f"parallelize: style {style!r} for {name}; use one of {', '.join(STYLES)} or a callable"
        )
    if style == "replicated":
        return replicated_from(module, name, sp)
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(
                f"parallelize: {name} is a {type(module).__name__}, not an "
                "nn.Embedding, so it cannot be 'vocab'"
            )
        layer = vocab_from(module, sequence_parallel=sp)
        embeddings[id(module.weight)] = layer
        return layer
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"parallelize: {name} is a {type(module).__name__}, not an nn.Linear, "
            f"so it cannot be {style!r}"
        )
    if style == "colwise":
        return column_from(module, gather_input=sp)
    if style == "rowwise":
        return row_from(module, all_reduce_output=not sp)
    if style == "head":
        return column_from(module, gather_input=sp, gather_output=True)
    embedding = embeddings.get(id(module.weight))
    if embedding is None:
        raise ValueError(
            f"parallelize: {name} is 'tied_head' but its weight is not the "
            "weight of a module the plan makes 'vocab'"
        )
    return TiedProjection(embedding, sequence_parallel=sp)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
