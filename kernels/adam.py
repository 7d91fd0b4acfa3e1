"""Adam step over one flat fp32 shard, optionally writing a half-precision copy.

Weight decay either decoupled (AdamW, `torch.optim.AdamW`; BMTrain's kernels for
fp16/bf16 parameters: p -= lr * wd * p) or L2 (`torch.optim.Adam`; BMTrain's update
of fp32 parameters: grad += wd * p before the moments), chosen by the caller.

One pass reads param, grad, exp_avg and exp_avg_sq and writes the three fp32 states
back (28 bytes per parameter with an fp32 grad), plus 2 bytes when the bf16/fp16
model copy is refreshed in the same pass instead of by a second `copy_` kernel that
would read the 4-byte master weight again.
"""

import math

import torch

from ._triton import INTERPRETED, tl, triton

PARAM_DTYPES = (torch.float32,)
GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COPY_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _adam_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    copy_ptr,
    n_elements,
    decay,
    beta1,
    beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    l2_decay,
    L2: tl.constexpr,
    HAS_COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 offsets: one shard may hold more than 2**31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)

    # Same order of operations as torch.optim.AdamW (decay first, then the update),
    # or as torch.optim.Adam (the decay joins the gradient; decay is then 1).
    if L2:
        grad = grad + l2_decay * param
    param = param * decay
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * (exp_avg / denom)

    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=mask)


def _hyper(lr, beta1, beta2, weight_decay, step, decoupled):
    """Host-side scalars in float64, so kernel and reference round the same way."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    return decay, lr / bias_correction1, math.sqrt(bias_correction2)


def adam_step_triton(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    model_copy=None,
    decoupled=True,
):
    """Launcher: one program per BLOCK elements; inputs already checked."""
    n_elements = param.numel()
    if n_elements == 0:
        return
    # 1024 x 4 warps saturates HBM on A100/H100 for a pure streaming kernel; under the
    # interpreter each program costs ~0.5 ms, so fewer, larger programs are faster.
    block = 4096 if INTERPRETED else 1024
    decay, step_size, bias_correction2_sqrt = _hyper(
        lr, beta1, beta2, weight_decay, step, decoupled
    )
    l2 = not decoupled and weight_decay != 0.0
    grid = (triton.cdiv(n_elements, block),)
    _adam_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        model_copy if model_copy is not None else param,
        n_elements,
        decay,
        beta1,
        beta2,
        eps,
        step_size,
        bias_correction2_sqrt,
        weight_decay,
        L2=l2,
        HAS_COPY=model_copy is not None,
        BLOCK=block,
        num_warps=4,
    )


@torch.no_grad()
def adam_step_torch(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    model_copy=None,
    decoupled=True,
):
    """Reference: the single-tensor torch.optim.AdamW (decoupled) or torch.optim.Adam
    (L2) update, in place."""
    decay, step_size, bias_correction2_sqrt = _hyper(
        lr, beta1, beta2, weight_decay, step, decoupled
    )
    grad = grad.float()
    if not decoupled and weight_decay != 0.0:
        grad = grad.add(param, alpha=weight_decay)  # a new tensor: the caller's grad stays
    param.mul_(decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if model_copy is not None:
        model_copy.copy_(param)


def check_adam_inputs(param, grad, exp_avg, exp_avg_sq, model_copy, step):
    """Raises ValueError/TypeError naming what is wrong and what is supported.

    Non-contiguous rule: the update is in place, so every tensor must be contiguous
    (a copy would be updated instead of the caller's tensor); shapes may differ as
    long as the element counts match, since all are read as flat buffers.
    """
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if model_copy is not None:
        tensors["model_copy"] = model_copy
    allowed = {
        "param": PARAM_DTYPES,
        "grad": GRAD_DTYPES,
        "exp_avg": PARAM_DTYPES,
        "exp_avg_sq": PARAM_DTYPES,
        "model_copy": COPY_DTYPES,
    }
    for name, tensor in tensors.items():
        if tensor.dtype not in allowed[name]:
            raise TypeError(
                f"adam_step_: {name} has dtype {tensor.dtype}; supported: "
                f"{', '.join(str(d) for d in allowed[name])}"
            )
        if tensor.numel() != param.numel():
            raise ValueError(
                f"adam_step_: {name} has {tensor.numel()} elements, param has {param.numel()}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"adam_step_: {name} is not contiguous; the update is in place, "
                "so pass contiguous tensors (copy back after a .contiguous())"
            )
        if tensor.device != param.device:
            raise ValueError(f"adam_step_: {name} is on {tensor.device}, param on {param.device}")
    if step < 1:
        raise ValueError(f"adam_step_: step counts from 1 (bias correction), got {step}")
