"""Cross-entropy with an online log-sum-exp, its gradient written in the forward pass.

One program per row walks the vocabulary in BLOCK-wide chunks twice: pass 1 keeps a
running max, a running sum of exp and the sum of logits (for label smoothing); pass 2
overwrites the same row with d loss / d logits. So the backward pass is one scale of
that buffer, and no second (rows x vocab) tensor is ever allocated: at 4096 x 128k
in bf16 that is 1 GiB that F.cross_entropy needs for log_softmax and again for its
gradient.
"""

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED, next_power_of_2, tl, triton

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _ce_kernel(
    logits_ptr,
    row_stride,
    target_ptr,
    loss_ptr,
    n_valid_ptr,
    row_scale_ptr,
    n_cols,
    ignore_index,
    label_smoothing,
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    target = tl.load(target_ptr + row).to(tl.int64)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(
                    row_ptr + cols,
                    tl.zeros([BLOCK], tl.float32).to(logits_ptr.dtype.element_ty),
                    mask=cols < n_cols,
                )
        return
    tl.device_assert((target >= 0) & (target < n_cols), "target out of [0, n_classes)")

    # Pass 1: online log-sum-exp (rescale the running sum whenever the max grows).
    running_max = float("-inf")
    sum_exp = 0.0
    sum_logits = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        sum_exp = sum_exp * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        sum_logits += tl.sum(tl.where(mask, x, 0.0), 0)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)

    # Smoothed target: (1 - eps) on the label plus eps / V everywhere, as in torch.
    x_target = tl.load(row_ptr + target).to(tl.float32)
    smooth = label_smoothing / n_cols
    loss = lse - (1.0 - label_smoothing) * x_target - smooth * sum_logits
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(n_valid_ptr)
        if HAS_ROW_SCALE:
            scale = scale * tl.load(row_scale_ptr + row)
        # Pass 2: softmax minus the smoothed one-hot, written over the logits.
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - smooth
            grad = tl.where(cols == target, grad - (1.0 - label_smoothing), grad)
            tl.store(row_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(
    x_ptr, row_stride, n_cols, n_col_blocks, scale_ptr, scale_stride, BLOCK: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    ptr = x_ptr + row * row_stride + cols
    scale = tl.load(scale_ptr + row * scale_stride)
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def scale_(x, scale):
    """`x *= scale` in place, in fp32 arithmetic, for the backward passes' rescaling.

    `scale` is a 1-element tensor (any contiguous `x`) or one value per row of a 2-D
    `x` with unit column stride. torch's own `bf16_tensor.mul_(fp32_scalar_tensor)`
    takes a generic, unvectorised kernel: on an H200 it spent 2.0 ms on 1 GiB of bf16
    gradient that a bandwidth-bound pass moves in 0.5 ms.
    """
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    if scale.numel() == 1:
        if not x.is_contiguous():
            return x.mul_(scale)
        rows, scale_stride = x.view(1, -1), 0
    else:
        rows, scale_stride = x, 1
        if x.dim() != 2 or x.stride(-1) != 1 or scale.numel() != x.shape[0]:
            raise ValueError(
                f"scale_: {scale.numel()} scales for a tensor of shape "
                f"{tuple(x.shape)} (expected one, or one per row of a 2-D tensor)"
            )
    n_rows, n_cols = rows.shape
    if rows.numel() == 0:
        return x
    block = min(next_power_of_2(n_cols), 65536 if INTERPRETED else 4096)
    n_col_blocks = triton.cdiv(n_cols, block)
    _scale_kernel[(n_rows * n_col_blocks,)](
        rows, rows.stride(0), n_cols, n_col_blocks, scale, scale_stride, BLOCK=block, num_warps=8
    )
    return x


def ce_rows_triton(
    logits, target, n_valid, *, ignore_index, label_smoothing, mean, write_grad, row_scale=None
):
    """Launcher: per-row fp32 loss; with `write_grad`, `logits` becomes its gradient.

    Args:
        logits: (N, V) with unit column stride (any row stride); overwritten if
            `write_grad`, with the gradient of the reduced loss (times `row_scale`).
        target: (N,) contiguous int32/int64.
        n_valid: 1-element fp32 tensor, the number of non-ignored rows (read on device,
            so the mean needs no host sync).
        mean: divide the gradient by n_valid.
        row_scale: optional (N,) fp32, multiplies each row's gradient.

    Returns:
        (N,) fp32 loss per row, 0 at ignored rows, never divided by n_valid.
    """
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    # 8192-wide chunks with 16 warps keep a 128k row in 16 trips without spilling;
    # the interpreter pays per trip, not per element, so it gets wider chunks.
    block = min(next_power_of_2(n_cols), 65536 if INTERPRETED else 8192)
    _ce_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        loss,
        n_valid,
        row_scale if row_scale is not None else loss,
        n_cols,
        ignore_index,
        float(label_smoothing),
        WRITE_GRAD=write_grad,
        MEAN=mean,
        HAS_ROW_SCALE=row_scale is not None,
        BLOCK=block,
        num_warps=16 if block >= 8192 else 8,
    )
    return loss


def reduce_rows(loss_rows, n_valid, reduction):
    if reduction == "mean":
        return loss_rows.sum() / n_valid[0]
    return loss_rows.sum() if reduction == "sum" else loss_rows


def as_rows(logits):
    """(..., V) -> (N, V) with unit column stride: a view when possible, else a copy."""
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class CrossEntropyFunction(torch.autograd.Function):
    """Forward computes loss and gradient; backward only rescales the stored gradient."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing):
        n_valid = (target != ignore_index).sum(dtype=torch.float32).reshape(1)
        loss_rows = ce_rows_triton(
            logits,
            target,
            n_valid,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            mean=reduction == "mean",
            write_grad=True,
        )
        # Triton wrote behind autograd's back: bump the version so any other node that
        # saved these logits fails loudly in backward instead of using the gradient.
        torch.autograd.graph.increment_version(logits)
        ctx.save_for_backward(logits.detach())
        ctx.reduction = reduction
        return reduce_rows(loss_rows, n_valid, reduction)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        # Always scale, even by 1: checking for 1 would cost a device-to-host sync.
        scale_(grad, grad_output)
        return grad, None, None, None, None


def cross_entropy_triton(logits, target, ignore_index, reduction, label_smoothing):
    rows = as_rows(logits)
    flat_target = target.reshape(-1).contiguous()
    if logits.requires_grad and torch.is_grad_enabled():
        loss = CrossEntropyFunction.apply(
            rows, flat_target, ignore_index, reduction, label_smoothing
        )
    else:
        n_valid = (flat_target != ignore_index).sum(dtype=torch.float32).reshape(1)
        loss_rows = ce_rows_triton(
            rows,
            flat_target,
            n_valid,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            mean=False,
            write_grad=False,
        )
        loss = reduce_rows(loss_rows, n_valid, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def cross_entropy_torch(logits, target, ignore_index, reduction, label_smoothing):
    """Reference: F.cross_entropy in fp32 (never writes to logits)."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def check_ce_inputs(logits, target, reduction, label_smoothing, op):
    """Raises TypeError/ValueError naming the problem and what is supported."""
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"{op}: logits have dtype {logits.dtype}; supported: "
            f"{', '.join(str(d) for d in LOGIT_DTYPES)}"
        )
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(
            f"{op}: target has dtype {target.dtype}; supported: "
            f"{', '.join(str(d) for d in TARGET_DTYPES)}"
        )
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(
            f"{op}: logits {tuple(logits.shape)} must be target's shape "
            f"{tuple(target.shape)} plus a class dimension"
        )
    check_loss_options(op, reduction, label_smoothing)


def check_loss_options(op, reduction, label_smoothing):
    """The reduction and smoothing checks every cross-entropy entry point shares."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r}; expected one of {', '.join(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} is outside [0, 1]")
