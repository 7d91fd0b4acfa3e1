"""`nbtrain.distributed`: collectives on whole tensors that autograd can go through.

BMTrain's `bmt.distributed` names, with BMTrain's shapes and gradients:

    all_gather(x)                 -> (world, *x.shape)
    all_reduce(x, op="sum")       -> x.shape, reduced over the ranks
    reduce_scatter(x, op="sum")   -> (x.shape[0] // world, *x.shape[1:]), this rank's rows
    broadcast(x, root)            -> root's x on every rank
    send_activations(x, next_rank) / recv_activations(prev_rank): a tensor and its
        shape and dtype, point to point (not differentiable)

See nbtrain.distributed.ops for the gradient each one gives. Their autograd Functions,
and every other differentiable collective of nbtrain (the tensor-parallel steps, the
MoE all-to-all), are defined once, in nbtrain.distributed.autograd.
"""

from .ops import (
    all_gather,
    all_reduce,
    broadcast,
    recv_activations,
    reduce_scatter,
    send_activations,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "recv_activations",
    "reduce_scatter",
    "send_activations",
]
