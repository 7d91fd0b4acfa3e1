"""Cross-entropy of logits split by vocabulary over the tp ranks (`FusedCrossEntropy(
parallel=True)` and `VPEmbedding(projection=True)`'s loss), without gathering them."""

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from ..comm.accounting import CommKind
from . import comm as tp_comm


def target_weights(weight, target, ignore_index):
    """weight[target] per row in fp32, 0 where the target is ignored."""
    weight = weight.to(target.device)
    kept = target != ignore_index
    picked = weight[torch.where(kept, target, torch.zeros_like(target))].float()
    return torch.where(kept, picked, torch.zeros_like(picked))


def reduce_weighted(loss_rows, rows_weight, reduction):
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
        rows_weight = target_weights(weight, t, ignore_index)
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
    return reduce_weighted(loss, rows_weight, reduction)
