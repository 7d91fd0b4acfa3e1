"""LayerNorm over the last dimension, forward and backward, computed in fp32.

Same plan as rms_norm.py: forward is one program per row and saves mean and 1/std
(8 bytes per row); backward runs one program per SM over bands of rows, keeping
partial d weight and d bias in registers.
"""

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .rms_norm import as_rows, backward_programs, norm_launch_config


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,
    x_row_stride,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / n_cols
    # Two-pass variance (mean first): E[x^2] - E[x]^2 cancels badly for large means.
    centered = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / n_cols + eps)
    y = centered * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    x_row_stride,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    # int64 rows: row * stride can pass 2**31 on large activations.
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = w * dy
        # Remove the components of wdy along 1 (the mean) and x_hat (the variance).
        mean_wdy = tl.sum(wdy, 0) / n_cols
        mean_wdy_xhat = tl.sum(wdy * x_hat, 0) / n_cols
        dx = rstd * (wdy - mean_wdy - x_hat * mean_wdy_xhat)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)
    tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=mask)


def layer_norm_forward(x2d, weight, bias, eps):
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty_like(mean)
    block, num_warps = norm_launch_config(n_cols)
    if n_rows:
        _layer_norm_fwd_kernel[(n_rows,)](
            x2d,
            x2d.stride(0),
            weight,
            bias if bias is not None else weight,
            y,
            mean,
            rstd,
            n_cols,
            eps,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return y, mean, rstd


def layer_norm_backward(dy, x2d, weight, mean, rstd):
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    programs = backward_programs(n_rows, x2d.device)
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x2d.device)
    db_partial = torch.zeros_like(dw_partial)
    block, num_warps = norm_launch_config(n_cols)
    if n_rows:
        _layer_norm_bwd_kernel[(programs,)](
            dy,
            x2d,
            x2d.stride(0),
            weight,
            mean,
            rstd,
            dx,
            dw_partial,
            db_partial,
            n_rows,
            n_cols,
            triton.cdiv(n_rows, programs),
            BLOCK=block,
            num_warps=num_warps,
        )
    return dx, dw_partial.sum(0), db_partial.sum(0)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy.contiguous(), x2d, weight, mean, rstd)
        db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
        return dx, dw.to(weight.dtype), db, None


def layer_norm_triton(x, weight, bias, eps):
    return LayerNormFunction.apply(as_rows(x), weight, bias, eps).reshape(x.shape)


def layer_norm_torch(x, weight, bias, eps):
    """Reference, in fp32 then cast back to x.dtype like the kernel."""
    y = F.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    )
    return y.to(x.dtype)
