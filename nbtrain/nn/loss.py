"""Losses with BMTrain's names, backed by the fused kernels in `nbtrain.kernels`."""

import torch
import torch.nn.functional as F
from torch import nn


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
        rows_weight = _target_weights(self.weight, target, self.ignore_index)
        return _reduce_weighted(loss * rows_weight, rows_weight, self.reduction)

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


def _target_weights(weight, target, ignore_index):
    """weight[target] per row in fp32, 0 where the target is ignored."""
    weight = weight.to(target.device)
    kept = target != ignore_index
    picked = weight[torch.where(kept, target, torch.zeros_like(target))].float()
    return torch.where(kept, picked, torch.zeros_like(picked))


def _reduce_weighted(loss_rows, rows_weight, reduction):
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / rows_weight.sum()


def parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    weight=None,
) -> torch.Tensor:
    """Cross-entropy of logits sharded by vocabulary over the tensor-parallel ranks.

    Each tp rank holds columns [tp_rank x V_local, (tp_rank + 1) x V_local) of the
    logits of the same tokens; `target` holds vocabulary ids (or ignore_index) and is
    the same on every tp rank. Three all-reduces of one number per token (the max,
    the sum of exponentials, the target's logit; a fourth with label smoothing)
    replace the gather of the logits. Columns that are -inf (a padded vocabulary)
    count as absent. `weight` (optional) holds one weight per class of the whole
    vocabulary (padding columns excluded; the same tensor on every tp rank), with
    `F.cross_entropy`'s meaning. Every tp rank returns the same loss, in fp32, and
    backward gives each rank the gradient of its own columns.

    Collective: every rank of the tp group calls this with the same target.
    """
    from ..comm import collectives as C
    from ..comm.accounting import CommKind
    from . import tp_comm

    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; expected mean, sum or none")
    group, size, rank = tp_comm.tp_group()
    x = logits.float().reshape(-1, logits.shape[-1])
    t = target.reshape(-1).to(x.device)
    local_vocab = x.shape[-1]
    if weight is not None:
        padded = size * local_vocab
        if weight.dim() != 1 or not padded - local_vocab < weight.shape[0] <= padded:
            raise ValueError(
                f"FusedCrossEntropy(parallel=True): weight has shape {tuple(weight.shape)}; "
                f"it needs one weight per class of the whole vocabulary: {size} tp ranks x "
                f"{local_vocab} columns, less the padding ({padded - local_vocab + 1} to "
                f"{padded} classes)"
            )
    with torch.no_grad():
        row_max = x.max(dim=-1).values
        if size > 1:
            C.all_reduce(
                row_max, op="max", group=group, label="tp loss max", kind=CommKind.TP_ALL_REDUCE
            )
    shifted = x - row_max.unsqueeze(-1)
    sum_exp = tp_comm.reduce_to_tp(shifted.exp().sum(-1))
    local_t = t - rank * local_vocab
    mine = (local_t >= 0) & (local_t < local_vocab) & (t != ignore_index)
    picked = shifted.gather(1, local_t.clamp(0, local_vocab - 1).unsqueeze(1)).squeeze(1)
    target_logit = tp_comm.reduce_to_tp(torch.where(mine, picked, torch.zeros_like(picked)))
    kept = t != ignore_index
    if weight is None:
        loss = sum_exp.log() - (1.0 - label_smoothing) * target_logit
        rows_weight = kept.float()
    else:
        rows_weight = _target_weights(weight, t, ignore_index)
        loss = (1.0 - label_smoothing) * rows_weight * (sum_exp.log() - target_logit)
    if label_smoothing:
        finite = torch.isfinite(x)
        kept_logits = torch.where(finite, shifted, torch.zeros_like(shifted))
        classes = finite[:1].sum().reshape(1).float()
        if size > 1:
            C.all_reduce(
                classes, op="sum", group=group, label="tp loss classes", kind=CommKind.TP_ALL_REDUCE
            )
        if weight is None:
            loss = loss - label_smoothing * tp_comm.reduce_to_tp(kept_logits.sum(-1)) / classes
        else:
            # sum_c w_c * -log p_c = W * log(sum exp) - sum_c w_c * shifted_c, over all ranks
            w = weight.float().to(x.device)
            w = F.pad(w, (0, size * local_vocab - w.shape[0]))
            w_local = w[rank * local_vocab : (rank + 1) * local_vocab]
            weighted = tp_comm.reduce_to_tp((kept_logits * w_local).sum(-1))
            loss = loss + label_smoothing * (w.sum() * sum_exp.log() - weighted) / classes
    loss = torch.where(kept, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape)
    return _reduce_weighted(loss, rows_weight, reduction)
