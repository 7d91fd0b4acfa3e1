"""RMSNorm over the last dimension, forward and backward, computed in fp32.

Forward: one program per row holds the whole row (H <= 65536) and saves 1/rms per
row (4 bytes) for backward instead of the normalised row. Backward: a fixed number
of programs (one per SM on a GPU) each take a contiguous band of rows and keep their
partial d weight in registers, so d weight costs (programs x H) fp32 of scratch rather
than an atomic add per row.
"""

import torch

from ._triton import INTERPRETED, next_power_of_2, tl, triton

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 65536  # one row must fit in one program's registers


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, x_row_stride, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    x_row_stride,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
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
    # int64 rows: row * stride can pass 2**31 on large activations.
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = w * dy
        # d/dx of x * rstd: the rstd term plus its dependence on every x in the row.
        dx = rstd * (wdy - x_hat * (tl.sum(wdy * x_hat, 0) / n_cols))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


def backward_programs(n_rows, device):
    """Programs for the backward band split: one per SM, fewer under the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return max(1, min(n_rows, 4))
    return max(1, min(n_rows, torch.cuda.get_device_properties(device).multi_processor_count))


def norm_launch_config(n_cols):
    block = next_power_of_2(n_cols)
    return block, min(max(block // 256, 1), 16)


def rms_norm_forward(x2d, weight, eps):
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    block, num_warps = norm_launch_config(n_cols)
    if n_rows:
        _rms_norm_fwd_kernel[(n_rows,)](
            x2d, x2d.stride(0), weight, y, rstd, n_cols, eps, BLOCK=block, num_warps=num_warps
        )
    return y, rstd


def rms_norm_backward(dy, x2d, weight, rstd):
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    programs = backward_programs(n_rows, x2d.device)
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x2d.device)
    block, num_warps = norm_launch_config(n_cols)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            dy,
            x2d,
            x2d.stride(0),
            weight,
            rstd,
            dx,
            dw_partial,
            n_rows,
            n_cols,
            triton.cdiv(n_rows, programs),
            BLOCK=block,
            num_warps=num_warps,
        )
    return dx, dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        y, rstd = rms_norm_forward(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.contiguous(), x2d, weight, rstd)
        return dx, dw, None


def as_rows(x):
    """(..., H) -> (N, H) with unit column stride: a view when possible, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_triton(x, weight, eps):
    return RMSNormFunction.apply(as_rows(x), weight, eps).reshape(x.shape)


def rms_norm_torch(x, weight, eps):
    """Reference, in fp32 then cast back to x.dtype like the kernel."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def check_norm_inputs(x, weight, bias, op):
    """Raises TypeError/ValueError naming the problem and what is supported."""
    supported = ", ".join(str(d) for d in NORM_DTYPES)
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in NORM_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; supported: {supported}")
    hidden = x.shape[-1] if x.dim() else 0
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tuple(tensor.shape) != (hidden,):
            raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected ({hidden},)")
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"{op}: last dimension {hidden} is outside 1..{MAX_HIDDEN}")
