"""Parameters frozen one at a time inside a Block's flat buffer.

A flat group trains as one `nn.Parameter` (its shard), yet `requires_grad_(False)` on
one parameter of it freezes that parameter alone, as in BMTrain and plain PyTorch:

  * forward gives the module a detached view of a frozen parameter, so autograd
    computes no gradient for it (its part of the reduced gradient is zero, and a
    gradient it holds from earlier steps stays as it was);
  * `SlotGrads` remembers which parameters hold a gradient in the shard's gradient
    tensor: those trainable in a backward since that tensor was made. The others read
    `.grad is None`, as a frozen torch parameter after `zero_grad()` does;
  * an optimizer's step leaves alone the elements of the parameters without a
    gradient, values and per-element state (momentum, Adam's moments), as torch's
    optimizers skip a parameter whose `.grad` is None (`guard_optimizer_steps`).

Adam's step count: nbtrain's AdamOptimizer (and AdamOffloadOptimizer) counts steps per
parameter of a shard once one was frozen (optim/segment_steps.py), so a parameter
frozen for some steps and thawed gets its own bias correction, as torch's. torch's own
optimizers (torch.optim.Adam/AdamW) stepping a shard keep one count for the whole
shard, which every step of the shard advances: there a thawed parameter's bias
correction differs from a separate parameter's. And SGD with `dampening` starts a
thawed parameter's momentum at (1 - dampening) * grad, not grad.
"""

from __future__ import annotations

import weakref

import torch

from .placement import placement_of

# optimizer -> its frozen elements' values and state, saved before its step and put back after
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SlotGrads:
    """Which parameters (slots) of a flat group hold a gradient in its shard's current
    gradient tensor. Local bookkeeping, no communication.

    The gradient tensor is known by identity: one this group made (its first reduced
    gradient after `zero_grad(set_to_none=True)`) holds the slots trainable in the
    backwards added into it since; one set from outside (a user's, an optimizer's)
    holds every slot."""

    def __init__(self, count: int):
        self.count = count
        self._tensor = None  # weakref to the gradient tensor the slots describe
        self._slots: frozenset[int] = frozenset()

    def _describes(self, grad: torch.Tensor) -> bool:
        return self._tensor is not None and self._tensor() is grad

    def added(self, grad: torch.Tensor, trainable, created: bool) -> None:
        """A backward's gradient went into `grad` (a new tensor when `created`), for
        the slots flagged in `trainable`."""
        if created:
            base = frozenset()
        elif self._describes(grad):
            base = self._slots
        else:
            base = frozenset(range(self.count))
        self._slots = base | {i for i, t in enumerate(trainable) if t}
        self._tensor = weakref.ref(grad)

    def has(self, grad: torch.Tensor | None, slot: int) -> bool:
        """Whether slot `slot` holds a gradient in `grad` (the shard's current one)."""
        if grad is None:
            return False
        return slot in self._slots if self._describes(grad) else True


def shard_grad(shard: torch.Tensor) -> torch.Tensor | None:
    """The gradient a flat shard's optimizer reads: `main_grad` when kept, else `.grad`."""
    grad = getattr(shard, "main_grad", None)
    return shard.grad if grad is None else grad


class _StepGuard:
    """torch's process-wide optimizer step hooks, installed once (the first time a
    flat group trains only some of its parameters): before a step, the elements of
    every shard the step may touch that belong to parameters without a gradient are
    saved, values and same-shaped state; after it, put back (state the step created
    there is zeroed: zero moments and momentum are what a fresh parameter starts from;
    integer state it created, such as AdamOptimizer's per-parameter step counts, is
    the optimizer's own and stays).
    The saved copies live on the optimizer object for the length of its step."""

    def __init__(self):
        self.handles = None

    def install(self) -> None:
        if self.handles is None:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self.handles = (
                register_optimizer_step_pre_hook(_save_frozen),
                register_optimizer_step_post_hook(_restore_frozen),
            )


_GUARD = _StepGuard()  # torch's hook registry is process-wide; so is this handle


def guard_optimizer_steps() -> None:
    """Makes every torch optimizer (nbtrain's are torch optimizers) skip the frozen
    parameters inside flat shards from now on. Local; idempotent."""
    _GUARD.install()


def frozen_spans(param) -> list:
    """[lo, hi) ranges of a flat shard's parameters without a gradient now ([] for
    any other tensor). Local."""
    flat = placement_of(param).flat
    return flat.frozen_spans() if flat is not None else []


def partly_frozen(param) -> bool:
    """Whether a flat shard's group has a parameter without a gradient now (on any
    rank: the same answer on every rank; False for any other tensor). Local."""
    flat = placement_of(param).flat
    return flat is not None and flat.partly_frozen()


def segment_spans(param) -> list:
    """[lo, hi) range of each parameter with elements in a flat shard ([] for any
    other tensor). Local."""
    flat = placement_of(param).flat
    return flat.segments() if flat is not None else []


@torch.no_grad()
def _save_frozen(optimizer, args, kwargs):
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            spans = frozen_spans(p)
            if not spans:
                continue
            state = optimizer.state.get(p, {})
            kept = {
                k: [v[lo:hi].clone() for lo, hi in spans]
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.shape == p.shape
            }
            saved.append((p, spans, [p.detach()[lo:hi].clone() for lo, hi in spans], kept))
    _SAVED[optimizer] = saved


@torch.no_grad()
def _restore_frozen(optimizer, args, kwargs):
    for p, spans, values, kept in _SAVED.pop(optimizer, []):
        for (lo, hi), value in zip(spans, values):
            p.detach()[lo:hi].copy_(value)
        for k, v in optimizer.state.get(p, {}).items():
            if not (isinstance(v, torch.Tensor) and v.shape == p.shape):
                continue
            for i, (lo, hi) in enumerate(spans):
                if k in kept:
                    v[lo:hi].copy_(kept[k][i])
                elif v.is_floating_point():  # not the optimizer's own counts (integers)
                    v[lo:hi].zero_()
