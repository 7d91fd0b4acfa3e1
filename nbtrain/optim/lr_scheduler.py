"""Learning-rate schedules with linear warmup (BMTrain's names and signatures).

    sched = Cosine(optimizer, start_lr=1e-3, warmup_iter=100, end_iter=10_000)
    manager.add_optimizer(optimizer, sched)      # the manager steps it

`num_iter` counts applied optimizer steps. For `num_iter < warmup_iter` the rate
rises linearly from 0 to `start_lr` (Noam: to `start_lr / sqrt(warmup_iter)`);
from there on each class decays it its own way. Construction sets the rate for
`num_iter` at once. Every rank holds the same schedule: no communication.

As in BMTrain, a subclass may define `get_lr_warmup(num_iter)` and
`get_lr_decay(num_iter)`; nbtrain's classes define `warmup_lr` / `decay_lr`, which
those call. Unlike BMTrain's, Linear and Cosine stay at 0 after `end_iter` (BMTrain's
cosine rises again) and a zero-length decay divides by 1, not 0.
"""

from __future__ import annotations

import math


class WarmupLRScheduler:
    """Base class: linear warmup, then `decay_lr(num_iter)`.

    Args:
        optimizer: any torch optimizer; every param group's "lr" is set.
        start_lr: the rate at the end of warmup.
        warmup_iter: warmup length in steps (0: no warmup).
        end_iter: step at which the decay reaches its end.
        num_iter: the step to start at (resuming).
    """

    def __init__(
        self, optimizer, start_lr: float, warmup_iter: int, end_iter: int, num_iter: int = 0
    ):
        if warmup_iter < 0 or num_iter < 0:
            raise ValueError(f"warmup_iter={warmup_iter} and num_iter={num_iter} must be >= 0")
        self.optimizer = optimizer
        self.start_lr = float(start_lr)
        self.warmup_iter, self.end_iter = int(warmup_iter), int(end_iter)
        self.num_iter = int(num_iter)
        self._current_lr = None
        self.step(self.num_iter)

    def warmup_lr(self, num_iter: int) -> float:
        return self.start_lr * num_iter / self.warmup_iter

    def decay_lr(self, num_iter: int) -> float:
        raise NotImplementedError

    def get_lr_warmup(self, num_iter: int) -> float:
        """BMTrain's name for the rate during warmup."""
        return self.warmup_lr(num_iter)

    def get_lr_decay(self, num_iter: int) -> float:
        """BMTrain's name for the rate after warmup."""
        return self.decay_lr(num_iter)

    def get_lr(self) -> float:
        if self.num_iter < self.warmup_iter:
            return self.get_lr_warmup(self.num_iter)
        return self.get_lr_decay(self.num_iter)

    @property
    def current_lr(self) -> float:
        return self._current_lr

    def step(self, num_iter: int | None = None) -> None:
        """Advances one step (or jumps to `num_iter`) and sets the optimizer's lr."""
        self.num_iter = self.num_iter + 1 if num_iter is None else int(num_iter)
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self) -> dict:
        return {
            "start_lr": self.start_lr,
            "warmup_iter": self.warmup_iter,
            "end_iter": self.end_iter,
            "num_iter": self.num_iter,
        }

    def load_state_dict(self, state: dict) -> None:
        self.start_lr = float(state["start_lr"])
        self.warmup_iter, self.end_iter = int(state["warmup_iter"]), int(state["end_iter"])
        self.step(int(state["num_iter"]))


class NoDecay(WarmupLRScheduler):
    """Warmup, then `start_lr` for ever."""

    def decay_lr(self, num_iter: int) -> float:
        return self.start_lr


class Noam(WarmupLRScheduler):
    """Warmup to `start_lr / sqrt(warmup_iter)`, then `start_lr / sqrt(num_iter)`
    (the Transformer paper's schedule; continuous at the end of warmup)."""

    def warmup_lr(self, num_iter: int) -> float:
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def decay_lr(self, num_iter: int) -> float:
        return self.start_lr / math.sqrt(max(num_iter, 1))


class Linear(WarmupLRScheduler):
    """Warmup, then a straight line from `start_lr` to 0 at `end_iter` (0 after)."""

    def decay_lr(self, num_iter: int) -> float:
        span = max(1, self.end_iter - self.warmup_iter)
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / span)


class Cosine(WarmupLRScheduler):
    """Warmup, then half a cosine from `start_lr` to 0 at `end_iter` (0 after)."""

    def decay_lr(self, num_iter: int) -> float:
        span = max(1, self.end_iter - self.warmup_iter)
        progress = min(1.0, (num_iter - self.warmup_iter) / span)
        return max(0.0, self.start_lr * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Exponential(WarmupLRScheduler):
    """Warmup, then `start_lr * gamma ** (num_iter - warmup_iter)`.

    Args:
        gamma: decay per step (BMTrain's default 0.95).
    """

    def __init__(
        self,
        optimizer,
        start_lr: float,
        warmup_iter: int,
        end_iter: int,
        num_iter: int = 0,
        gamma: float = 0.95,
    ):
        self.gamma = float(gamma)  # before super(): construction computes a rate
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def decay_lr(self, num_iter: int) -> float:
        return self.start_lr * self.gamma ** (num_iter - self.warmup_iter)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "gamma": self.gamma}

    def load_state_dict(self, state: dict) -> None:
        self.gamma = float(state.get("gamma", self.gamma))
        super().load_state_dict(state)


__all__ = ["Cosine", "Exponential", "Linear", "NoDecay", "Noam", "WarmupLRScheduler"]
