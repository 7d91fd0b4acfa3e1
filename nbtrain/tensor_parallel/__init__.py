"""Tensor parallelism: each rank of a tp group holds a slice of every large weight.

Read in this order:
    comm.py           the communication steps between tp layers (gather or reduce-
                      scatter the tokens, Megatron's copy and all-reduce), each
                      differentiable, through nbtrain.distributed.autograd
    slices.py         a slice and its full tensor: cutting one from the other, and back
    layers.py         `ColumnParallelLinear`, `RowParallelLinear`, `VPEmbedding` (BMTrain's
                      names and flags), nbtrain's `LayerNorm`, and
                      `declare_tp_gradients`: a model's layout between its tp layers
    partial.py        replicated parameters' gradients over tp: whole or partial, by
                      declaration (or the layout the layers make), checked once
    ops.py            BMTrain's autograd functions `OpLinear`, `OpParallelLinear`
    cross_entropy.py  the loss of vocabulary-split logits, without gathering them
    parallelize.py    `parallelize(model, plan)`: a plain model's layers swapped for tp
                      ones in place (the plans for nbtrain's models live beside them:
                      nbtrain.models.gpt_tp, nbtrain.models.hf_tp)
    reshard.py        a checkpoint's tp slices read at another tp size

`slices.py` and `partial.py` sit below nbtrain.zero (its Blocks cut slices and reduce
replicated gradients with them); the rest sits above it. This package imports
nothing when loaded, so zero can use those two without a cycle; its public names
load on first use:

    from nbtrain.tensor_parallel import ColumnParallelLinear, parallelize

BMTrain's names stay where BMTrain has them (`nbtrain.nn.ColumnParallelLinear`,
`nbtrain.nn.OpParallelLinear`, `nbtrain.parallelize`, `nbtrain.declare_tp_gradients`).
"""

import importlib

_PUBLIC = {
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VPEmbedding": "layers",
    "LayerNorm": "layers",
    "declare_tp_gradients": "layers",
    "OpLinear": "ops",
    "OpParallelLinear": "ops",
    "ReduceType": "ops",
    "parallel_cross_entropy": "cross_entropy",
    "parallelize": "parallelize",
    "Plan": "parallelize",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'nbtrain.tensor_parallel' has no attribute {name!r}")
