"""Output projection + cross-entropy, chunked over tokens so all logits never exist.

Per chunk of tokens: logits = hidden_chunk @ weight.T (cuBLAS), the cross-entropy
kernel turns them into d loss / d logits in place, and two more GEMMs fold that into
d hidden and d weight. At 4096 tokens x 128k vocabulary in bf16 the full logits are
1 GiB, and the plain composition holds two or three such buffers at its peak; here one
chunk (2**26 logits, 128 MiB by default) plus the weight gradient is the peak.

For reduction "mean"/"sum" the gradients are computed in the forward pass and backward
only scales them. For "none" the per-row upstream gradient is unknown until backward,
so backward recomputes each chunk's logits (one extra GEMM) with the rows scaled.
"""

import torch
import torch.nn.functional as F

from .cross_entropy import (
    LOGIT_DTYPES,
    TARGET_DTYPES,
    ce_rows_triton,
    check_loss_options,
    cross_entropy_torch,
    reduce_rows,
    scale_,
)

CHUNK_LOGITS = 1 << 26


def default_chunk_tokens(n_tokens, vocab):
    """Largest power of two with chunk x vocab <= 2**26 (tall GEMMs stay efficient)."""
    chunk = 1
    while chunk * 2 * vocab <= CHUNK_LOGITS and chunk < n_tokens:
        chunk *= 2
    return chunk


def chunked_pass(
    hidden,
    weight,
    bias,
    target,
    n_valid,
    *,
    ignore_index,
    label_smoothing,
    mean,
    chunk_tokens,
    needs=(False, False, False),
    row_scale=None,
):
    """Loss per row and, for each True in `needs`, d hidden, d weight, d bias.

    Args:
        hidden: (N, H); weight: (V, H); bias: (V,) or None; target: (N,) contiguous.
        n_valid: 1-element fp32 tensor, the number of non-ignored rows.
        needs: which of (hidden, weight, bias) gradients to form.
        row_scale: optional (N,) fp32 upstream gradient per row (reduction "none").
    """
    n_tokens = hidden.shape[0]
    write_grad = any(needs)
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = (
        torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs[0] else None
    )
    grad_weight = torch.zeros_like(weight) if needs[1] else None
    # The bias gradient is tiny (V,), so it can afford fp32 accumulation.
    grad_bias = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=hidden.device)
        if needs[2]
        else None
    )
    for start in range(0, n_tokens, chunk_tokens):
        end = min(start + chunk_tokens, n_tokens)
        hidden_chunk = hidden[start:end]
        logits = F.linear(hidden_chunk, weight, bias)
        loss_rows[start:end] = ce_rows_triton(
            logits,
            target[start:end],
            n_valid,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            mean=mean,
            write_grad=write_grad,
            row_scale=None if row_scale is None else row_scale[start:end],
        )
        # From here `logits` holds d loss / d logits for this chunk.
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            grad_weight.addmm_(logits.t(), hidden_chunk)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=torch.float32)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss_rows, grad_hidden, grad_weight, grad_bias


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_tokens
    ):
        n_valid = (target != ignore_index).sum(dtype=torch.float32).reshape(1)
        ctx.options = dict(
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            mean=reduction == "mean",
            chunk_tokens=chunk_tokens,
        )
        ctx.reduction = reduction
        needs = tuple(ctx.needs_input_grad[:3])
        if reduction == "none":
            loss_rows, *_ = chunked_pass(hidden, weight, bias, target, n_valid, **ctx.options)
            ctx.save_for_backward(hidden, weight, bias, target, n_valid)
        else:
            loss_rows, *grads = chunked_pass(
                hidden, weight, bias, target, n_valid, needs=needs, **ctx.options
            )
            ctx.save_for_backward(*grads)
        return reduce_rows(loss_rows, n_valid, reduction)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            hidden, weight, bias, target, n_valid = ctx.saved_tensors
            _, *grads = chunked_pass(
                hidden,
                weight,
                bias,
                target,
                n_valid,
                needs=tuple(ctx.needs_input_grad[:3]),
                row_scale=grad_output.float().contiguous(),
                **ctx.options,
            )
        else:
            grads = [g if g is None else scale_(g, grad_output) for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None)


def linear_cross_entropy_triton(
    hidden, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_tokens
):
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).contiguous()
    chunk = chunk_tokens or default_chunk_tokens(rows.shape[0], weight.shape[0])
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    ):
        loss = LinearCrossEntropyFunction.apply(
            rows, weight, bias, flat_target, ignore_index, reduction, label_smoothing, chunk
        )
    else:
        n_valid = (flat_target != ignore_index).sum(dtype=torch.float32).reshape(1)
        loss_rows, *_ = chunked_pass(
            rows,
            weight,
            bias,
            flat_target,
            n_valid,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            mean=False,
            chunk_tokens=chunk,
        )
        loss = reduce_rows(loss_rows, n_valid, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def linear_cross_entropy_torch(
    hidden, weight, bias, target, ignore_index, reduction, label_smoothing
):
    """Reference: the plain composition, logits upcast to fp32 for the loss."""
    return cross_entropy_torch(
        F.linear(hidden, weight, bias), target, ignore_index, reduction, label_smoothing
    )


def check_lce_inputs(hidden, weight, bias, target, reduction, label_smoothing):
    """Raises TypeError/ValueError naming the problem and what is supported."""
    op = "linear_cross_entropy"
    if hidden.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"{op}: hidden has dtype {hidden.dtype}; supported: "
            f"{', '.join(str(d) for d in LOGIT_DTYPES)}"
        )
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != hidden.dtype:
            raise TypeError(
                f"{op}: {name} has dtype {tensor.dtype}; it must match hidden ({hidden.dtype})"
            )
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(
            f"{op}: target has dtype {target.dtype}; supported: "
            f"{', '.join(str(d) for d in TARGET_DTYPES)}"
        )
    if weight.dim() != 2 or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{op}: weight {tuple(weight.shape)} must be (vocab, "
            f"{hidden.shape[-1] if hidden.dim() else '?'})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"{op}: hidden {tuple(hidden.shape)} must be target's shape "
            f"{tuple(target.shape)} plus a hidden dimension"
        )
    check_loss_options(op, reduction, label_smoothing)
