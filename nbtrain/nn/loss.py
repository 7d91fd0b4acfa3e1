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
        parallel: the logits are sharded by vocabulary over the tensor-parallel ranks
            (as `VPEmbedding(x, projection=True)` makes them): the loss is computed
            without gathering them (`parallel_cross_entropy`).

    Shapes: logits (N, V) or (..., V) in fp32/fp16/bf16, target (N,) or (...) int64;
    the loss is fp32.
    """

    def __init__(
        self,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        parallel=False,
        *,
        weight=None,
        inplace=False,
        impl="auto",
    ):
        super().__init__()
        if weight is not None:
            raise NotImplementedError(
                "FusedCrossEntropy: class weights are not supported; "
                "use torch.nn.CrossEntropyLoss(weight=...) instead"
            )
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.inplace = inplace
        self.impl = impl
        self.parallel = parallel

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return parallel_cross_entropy(
                logits, target, self.ignore_index, self.reduction, self.label_smoothing
            )
        # Imported here so that `import nbtrain.nn.loss` does not import triton.
        from nbtrain.kernels import cross_entropy

        if not self.inplace and logits.requires_grad:
            logits = logits.clone()
        return cross_entropy(
            logits,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            impl=self.impl,
        )

    def extra_repr(self):
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, inplace={self.inplace}, "
            f"parallel={self.parallel}"
        )


def parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
) -> torch.Tensor:
    """Cross-entropy of logits sharded by vocabulary over the tensor-parallel ranks.

    Each tp rank holds columns [tp_rank x V_local, (tp_rank + 1) x V_local) of the
    logits of the same tokens; `target` holds vocabulary ids (or ignore_index) and is
    the same on every tp rank. Three all-reduces of one number per token (the max,
    the sum of exponentials, the target's logit; a fourth with label smoothing)
    replace the gather of the logits. Columns that are -inf (a padded vocabulary)
    count as absent. Every tp rank returns the same loss, in fp32, and backward
    gives each rank the gradient of its own columns.
    """
    from ..comm import collectives as C
    from . import tp_comm

    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; expected mean, sum or none")
    group, size, rank = tp_comm.tp_group()
    x = logits.float().reshape(-1, logits.shape[-1])
    t = target.reshape(-1).to(x.device)
    local_vocab = x.shape[-1]
    with torch.no_grad():
        row_max = x.max(dim=-1).values
        if size > 1:
            C.all_reduce(row_max, op="max", group=group, label="tp loss max")
    shifted = x - row_max.unsqueeze(-1)
    sum_exp = tp_comm.reduce_to_tp(shifted.exp().sum(-1))
    local_t = t - rank * local_vocab
    mine = (local_t >= 0) & (local_t < local_vocab) & (t != ignore_index)
    picked = shifted.gather(1, local_t.clamp(0, local_vocab - 1).unsqueeze(1)).squeeze(1)
    target_logit = tp_comm.reduce_to_tp(torch.where(mine, picked, torch.zeros_like(picked)))
    loss = sum_exp.log() - (1.0 - label_smoothing) * target_logit
    if label_smoothing:
        finite = torch.isfinite(x)
        total = tp_comm.reduce_to_tp(
            torch.where(finite, shifted, torch.zeros_like(shifted)).sum(-1)
        )
        classes = finite[:1].sum().reshape(1).float()
        if size > 1:
            C.all_reduce(classes, op="sum", group=group, label="tp loss classes")
        loss = loss - label_smoothing * total / classes
    kept = t != ignore_index
    loss = torch.where(kept, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / kept.sum()
