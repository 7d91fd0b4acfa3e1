"""One expert's computation, a rank's experts at once (one grouped matmul per weight
where torch has it: `experts_ffn`), and the whole layer as a plain one-process loop over
all experts (`moe_reference`, the reference the tests and tutorials compare with)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .routing import route


def expert_ffn(rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert: (n, hidden) -> (n, hidden), exact (erf) GELU between. n may be 0."""
    return F.gelu(rows @ w_in) @ w_out


def experts_ffn(
    rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Every local expert on its rows: (n, hidden) -> (n, hidden).

    Args:
        rows: (n, hidden), grouped by expert: the first counts[0] rows for expert 0, ...
        w_in: (E, hidden, ffn); w_out: (E, ffn, hidden); counts: E row counts, sum n.

    Two grouped matmuls (`torch.nn.functional.grouped_mm`, one kernel each for all the
    experts) where this torch has them for the device, dtype and widths, checked once
    against the loop (forward and backward); else, and for no rows at all, a loop of
    `expert_ffn`. Local.
    """
    if rows.shape[0] and uses_grouped_mm(rows.device.type, rows.dtype, *w_in.shape[1:]):
        return _grouped(rows, w_in, w_out, counts)
    return _looped(rows, w_in, w_out, counts)


def _looped(rows, w_in, w_out, counts):
    return torch.cat([expert_ffn(r, w_in[e], w_out[e]) for e, r in enumerate(rows.split(counts))])


def _grouped(rows, w_in, w_out, counts):
    offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    hidden = F.gelu(F.grouped_mm(rows, w_in, offs=offs))
    return _ContiguousGrad.apply(F.grouped_mm(hidden, w_out, offs=offs))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward
    refuses an expanded one (a sum's gradient is one value broadcast)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def uses_grouped_mm(device_type: str, dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether `experts_ffn` runs grouped_mm for experts of these widths here: it runs
    and matches the loop in a small forward and backward, checked once (CUDA's kernel
    wants some dtypes and alignments; CPU's takes fp32). Local."""
    if not hasattr(F, "grouped_mm"):
        return False
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 2]
    args = [
        torch.randn(shape, generator=g).to(device_type, dtype).requires_grad_()
        for shape in ((sum(counts), hidden), (3, hidden, ffn), (3, ffn, hidden))
    ]
    rows, w_in, w_out = args
    try:
        got = _grouped(rows, w_in, w_out, counts)
        got_grads = torch.autograd.grad(got.sum(), args)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = _looped(rows, w_in, w_out, counts)
    want_grads = torch.autograd.grad(want.sum(), args)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return all(
        torch.allclose(a, b, rtol=tol, atol=tol)
        for a, b in zip((got, *got_grads), (want, *want_grads))
    )


def moe_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same layer in one process, a plain loop over all experts (for tests).

    Args:
        x: (..., hidden) tokens; router_weight: (E, hidden); w_in: (E, hidden, ffn);
        w_out: (E, ffn, hidden); bias: (E,) selection bias; keep: (T, top_k) bool,
            the assignments kept (None: all).

    Returns (..., hidden). Local.
    """
    tokens = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(tokens @ router_weight.t(), dim=-1)
    chosen, weights = route(scores, top_k, bias)
    if keep is not None:
        weights = weights * keep
    out = torch.zeros_like(tokens)
    for e in range(router_weight.shape[0]):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        out = out.index_add(
            0, rows, expert_ffn(tokens[rows], w_in[e], w_out[e]) * weights[rows, slot].unsqueeze(1)
        )
    return out.reshape(x.shape)
