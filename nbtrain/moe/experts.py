"""One expert's computation, and the whole layer as a plain one-process loop over all
experts (`moe_reference`, the reference the tests and tutorials compare with)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .routing import route


def expert_ffn(rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert: (n, hidden) -> (n, hidden), exact (erf) GELU between. n may be 0."""
    return F.gelu(rows @ w_in) @ w_out


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
