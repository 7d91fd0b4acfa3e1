"""GradReducer: one model's gradient reductions in flight, finished in order.

Each sharded model (the root made by `wrap` or a `DistributedModule`, or a lone
`TransformerBlockList` or `Block`) owns one. Blocks queue their reduce-scatters
here and data-parallel buckets their all-reduces. Adding a reduction first
finishes the one before it: that one had the compute since its issue to hide
behind, and keeping one in flight bounds the gradient buffers alive at once. When
the backward pass ends, everything queued is finished, so no reduction outlives
the backward that started it.

State lives in the object, so two models in one process (a teacher and a
student, or a model rebuilt by re-running its cell) never share a queue.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch


class GradReducer:
    """Reductions in flight for one model, oldest first."""

    def __init__(self):
        self.queue: deque = deque()
        self.end_callbacks: list[Callable[[], None]] = []
        self.callback_queued = False

    def add(self, handle, finish: Callable[[], None]) -> None:
        """Queues a collective in flight and what to do once it completes.

        Call from backward: it also arranges for the queue to drain when this
        backward pass ends.
        """
        self.finish_all()
        self.queue.append((handle, finish))
        self._queue_end_callback()

    def at_end(self, fn: Callable[[], None]) -> None:
        """Runs `fn` when the current backward pass ends (call from backward)."""
        self.end_callbacks.append(fn)
        self._queue_end_callback()

    def finish_all(self) -> None:
        """Waits for every queued reduction and applies its result, oldest first."""
        while self.queue:
            handle, finish = self.queue.popleft()
            handle.wait()
            finish()

    def _queue_end_callback(self) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True

    def _end_of_backward(self) -> None:
        # Callbacks may issue collectives of their own (the data-parallel flush of
        # buckets that never filled): those are queued and finished here too.
        try:
            self.finish_all()
            while self.end_callbacks:
                callbacks, self.end_callbacks = self.end_callbacks, []
                for fn in callbacks:
                    fn()
                self.finish_all()
        finally:
            self.callback_queued = False
