"""What a step trains, told to telemetry without the user's help.

`nbt.wrap` and `OptimManager.add_optimizer` offer their model and optimizer here
(`offer`): the memory samples count their state unless the user chose others with
`telemetry.watch`. `count_batch_tokens(model)` counts the tokens of each training
forward (the first integer tensor of its inputs; `attention_mask`'s ones where one
is given) and records them as the step's `batch_tokens` metric at its end, so
tokens/s needs no `telemetry.metric(tokens=...)` call. Only the first rank of each
tensor-parallel group counts (its peers see the same tokens), so the ranks' counts
add up to the global batch; a pipeline's later stages see hidden states, not tokens.

Held by weak reference: offering keeps nothing alive. This is the comm layer (the
zero and optim layers call it); the telemetry layer reads it.
"""

from __future__ import annotations

import weakref

import torch

from . import events

_OFFERED: dict[str, weakref.ref | None] = {"model": None, "optimizer": None}
# model -> its token counter (the hook and the step-end method live with it)
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def offer(model=None, optimizer=None) -> None:
    """The newest wrapped model / added optimizer: what telemetry counts by default."""
    if model is not None:
        _OFFERED["model"] = weakref.ref(model)
    if optimizer is not None:
        _OFFERED["optimizer"] = weakref.ref(optimizer)


def offered() -> tuple:
    """(model, optimizer) last offered and still alive (None for either otherwise)."""
    return tuple(ref() if ref is not None else None for ref in _OFFERED.values())


class _TokenCounter:
    def __init__(self, counts: bool):
        self.counts = counts  # False on tensor-parallel peers: rank 0 of the group counts
        self.tokens = 0

    def pre_forward(self, module, args, kwargs) -> None:
        if not (self.counts and events.HUB.active and torch.is_grad_enabled()):
            return
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(mask) and mask.dtype in (torch.bool, torch.long, torch.int):
            self.tokens += int(mask.count_nonzero())
            return
        # Positional inputs first, then input_ids before any other keyword (labels).
        others = (v for k, v in kwargs.items() if k != "input_ids")
        inputs = [*args, kwargs.get("input_ids"), *others]
        ids = next((t for t in inputs if _is_token_ids(t)), None)
        if ids is not None:
            self.tokens += ids.numel()

    def end_step(self) -> None:
        if self.tokens:
            events.metric(batch_tokens=self.tokens)
            self.tokens = 0


def _is_token_ids(t) -> bool:
    return torch.is_tensor(t) and not t.is_floating_point() and t.dtype != torch.bool


def count_batch_tokens(model: torch.nn.Module, tp_rank: int = 0) -> None:
    """Count the tokens of `model`'s training forwards into each step's `batch_tokens`
    metric (idempotent)."""
    if model in _COUNTERS:
        return
    counter = _COUNTERS[model] = _TokenCounter(counts=tp_rank == 0)
    model.register_forward_pre_hook(counter.pre_forward, with_kwargs=True)
    events.on_step_end(counter.end_step)
