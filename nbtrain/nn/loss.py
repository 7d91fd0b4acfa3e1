"""Losses with BMTrain's names, backed by the fused kernels in `nbtrain.kernels`."""
import torch
from torch import nn


class FusedCrossEntropy(nn.Module):
    """Cross-entropy whose gradient is computed in the forward pass (BMTrain's name).

    On CUDA with triton installed this runs the Triton kernel (one pass for the loss,
    one for the gradient, no log-softmax buffer); elsewhere the torch reference.

    Args:
        ignore_index: target value whose rows add no loss and get zero gradient.
        reduction: "mean" (over non-ignored rows), "sum" or "none".
        label_smoothing: in [0, 1], as in `F.cross_entropy`.
        weight: per-class weights; accepted for BMTrain's signature but only None is
            supported.
        inplace: write the gradient into the logits' storage (saves one logits-sized
            buffer; the logits are unusable afterwards). With the default False the
            logits are copied first, as in BMTrain.
        impl: "auto", "triton" or "torch" (see `nbtrain.kernels`).

    Shapes: logits (N, V) or (..., V) in fp32/fp16/bf16, target (N,) or (...) int64;
    the loss is fp32.
    """

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                 weight=None, inplace=False, impl="auto"):
        super().__init__()
        if weight is not None:
            raise NotImplementedError("FusedCrossEntropy: class weights are not supported; "
                                      "use torch.nn.CrossEntropyLoss(weight=...) instead")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.inplace = inplace
        self.impl = impl

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Imported here so that `import nbtrain.nn.loss` does not import triton.
        from nbtrain.kernels import cross_entropy

        if not self.inplace and logits.requires_grad:
            logits = logits.clone()
        return cross_entropy(logits, target, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing,
                             impl=self.impl)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, inplace={self.inplace}")
