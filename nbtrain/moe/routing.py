"""Routing: which experts each token goes to, and which assignments an expert keeps.
Pure functions of one rank's tokens (no communication)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BALANCE_MODES = ("aux", "bias", "none")


def route(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None):
    """Top-k selection: (expert ids (T, k) int64, combine weights (T, k)).

    Selection uses scores + bias (bias only steers the choice); the combine weights
    are the selected *unbiased* scores renormalised to sum 1 per token. Local.
    """
    chosen = (scores if bias is None else scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    return chosen, weights / weights.sum(-1, keepdim=True)


def capacity_keep(chosen: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(T, k) bool: which assignments an expert keeps when it takes `capacity` from
    this rank. First come first kept, in token order (token 0's k choices, then
    token 1's ...). Local."""
    flat = chosen.reshape(-1)
    onehot = F.one_hot(flat, num_experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # 0-based arrival at its expert
    return (position < capacity).reshape(chosen.shape)
