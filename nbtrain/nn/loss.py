"""Losses with BMTrain's names, backed by the fused kernels in `nbtrain.kernels`."""

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.cross_entropy import (
    parallel_cross_entropy,
    reduce_weighted,
    target_weights,
)


class FusedCrossEntropy(nn.Module):
    """Cross-entropy whose gradient is computed in the forward pass (BMTrain's name).

    On CUDA with triton installed this runs the Triton kernel (one pass for the loss,
    one for the gradient, no log-softmax buffer); elsewhere the torch reference.

    Args (BMTrain's order):
        weight: per-class weights (1-D, one per class: the whole vocabulary with
            `parallel=True`), as in `F.cross_entropy`: a row's loss is multiplied by
            its target's weight and "mean" divides by the sum of the kept rows'
            weights. Any float dtype; the arithmetic is fp32.
        ignore_index: target value whose rows add no loss and get zero gradient.
        reduction: "mean" (over non-ignored rows), "sum" or "none".
        label_smoothing: in [0, 1], as in `F.cross_entropy` (with `weight` too).
            BMTrain's fp16 kernel ignores it; nbtrain applies it for every dtype.
        parallel: the logits are sharded by vocabulary over the tensor-parallel ranks
            (as `VPEmbedding(x, projection=True)` makes them): the loss is computed
            without gathering them (`parallel_cross_entropy`).
        inplace: write the gradient into the logits' storage (saves one logits-sized
            buffer; the logits are unusable afterwards). With the default False the
            logits are copied first, as in BMTrain.
        impl: "auto", "triton" or "torch" (see `nbtrain.kernels`).

    Shapes: logits (N, V) or (..., V) in fp32/fp16/bf16, target (N,) or (...) int64;
    the loss is fp32. Local (collective over the tp group with `parallel=True`).
    """

    def __init__(
        self,
        weight=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        parallel=False,
        *,
        inplace=False,
        impl="auto",
    ):
        super().__init__()
        if weight is not None and (not torch.is_tensor(weight) or weight.dim() != 1):
            raise ValueError(
                f"FusedCrossEntropy: weight must be a 1-D tensor, one weight per class; "
                f"got {type(weight).__name__} of shape {getattr(weight, 'shape', None)}"
            )
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction={reduction!r}; expected mean, sum or none")
        self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.inplace = inplace
        self.impl = impl
        self.parallel = parallel

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return parallel_cross_entropy(
                logits,
                target,
                self.ignore_index,
                self.reduction,
                self.label_smoothing,
                weight=self.weight,
            )
        if self.weight is not None:
            _check_weight(self.weight, logits.shape[-1], "the number of classes")
            if self.label_smoothing:
                # Smoothing weighs every class's log-probability: torch's formula, in fp32.
                loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]),
                    target.reshape(-1).long(),
                    weight=self.weight.float().to(logits.device),
                    ignore_index=self.ignore_index,
                    reduction=self.reduction,
                    label_smoothing=self.label_smoothing,
                )
                return loss.reshape(target.shape) if self.reduction == "none" else loss
        # Imported here so that `import nbtrain.nn.loss` does not import triton.
        from nbtrain.kernels import cross_entropy

        if not self.inplace and logits.requires_grad:
            logits = logits.clone()
        reduction = self.reduction if self.weight is None else "none"
        loss = cross_entropy(
            logits,
            target,
            ignore_index=self.ignore_index,
            reduction=reduction,
            label_smoothing=self.label_smoothing,
            impl=self.impl,
        )
        if self.weight is None:
            return loss
        rows_weight = target_weights(self.weight, target, self.ignore_index)
        return reduce_weighted(loss * rows_weight, rows_weight, self.reduction)

    def extra_repr(self):
        return (
            f"weight={None if self.weight is None else tuple(self.weight.shape)}, "
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, inplace={self.inplace}, "
            f"parallel={self.parallel}"
        )


def _check_weight(weight: torch.Tensor, n_classes: int, what: str) -> None:
    if weight.dim() != 1 or weight.shape[0] != n_classes:
        raise ValueError(
            f"FusedCrossEntropy: weight has shape {tuple(weight.shape)}; it needs one "
            f"weight per class, shape ({n_classes},) ({what})"
        )
