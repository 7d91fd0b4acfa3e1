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

A backward pass that raises half way (an error in user code, an interrupted
cell) never reaches its end: what it queued is stale. The first reduction of the
next backward pass notices the new pass (autograd's graph-task id), waits for the
stale collectives so every rank stays in step, and drops their results: a failed
backward contributes nothing to the gradients, as in plain PyTorch after
`zero_grad()`.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch


def current_backward() -> int:
    """Autograd's id of the backward pass running on this thread (-1 outside one)."""
    return torch._C._current_graph_task_id()


class GradReducer:
    """Reductions in flight for one model, oldest first."""

    def __init__(self):
        self.queue: deque = deque()
        self.end_callbacks: list[Callable[[], None]] = []
        self.backward_id: int | None = None  # the pass whose end callback is queued

    def add(self, handle, finish: Callable[[], None]) -> None:
        """Queues a collective in flight and what to do once it completes.

        Call from backward: it also arranges for the queue to drain when this
        backward pass ends.
        """
        self._queue_end_callback()
        self.finish_all()
        self.queue.append((handle, finish))

    def at_end(self, fn: Callable[[], None]) -> None:
        """Runs `fn` when the current backward pass ends (call from backward)."""
        self._queue_end_callback()
        self.end_callbacks.append(fn)

    def finish_all(self) -> None:
        """Waits for every queued reduction and applies its result, oldest first."""
        while self.queue:
            handle, finish = self.queue.popleft()
            if getattr(handle, "stale", False):
                continue  # its group was aborted by a failure: no result to apply
            handle.wait()
            finish()

    def _queue_end_callback(self) -> None:
        backward_id = current_backward()
        if backward_id == self.backward_id:
            return
        if self.backward_id is not None:
            self._drop_stale()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.backward_id = backward_id

    def _drop_stale(self) -> None:
        """The previous backward pass died before its end: finish its collectives (every
        rank issued them) and throw their results and end callbacks away."""
        for handle, _ in self.queue:
            if not getattr(handle, "stale", False):  # an aborted group's: never completes
                handle.wait()
        self.queue.clear()
        self.end_callbacks.clear()

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
            self.backward_id = None
