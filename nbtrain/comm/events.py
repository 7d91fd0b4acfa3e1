"""What the engine reports, and to whom: a small publish/subscribe hub.

The comm, zero and optim layers describe what they do (a collective issued or
completed, a block's compute, a step's metrics, the end of a step) as plain
dict events and hand them to `publish`. They never import telemetry: the
telemetry layer subscribes its recorder here when a run starts
(`nbtrain.init_distributed`), and anyone else (a test, a profiler) may subscribe too.
With no subscriber, or with publishing switched off, each hot-path call costs one attribute read.

Every event carries the training step it belongs to (`step`), advanced by
`end_step()` (OptimManager.step calls it), which also runs the methods registered
with `on_step_end` (a MoE layer's loss-free bias moves once per step there).
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from typing import Callable

Subscriber = Callable[[dict], None]


class EventHub:
    """Subscribers, the on/off switch and the step counter of this process."""

    def __init__(self):
        self.subscribers: list[Subscriber] = []
        self.enabled = True
        self.step = 0

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.subscribers)


HUB = EventHub()
_STEP_END: list[weakref.WeakMethod] = []


def on_step_end(method) -> None:
    """Calls the bound method `method` at every `end_step()`, until its object is
    collected (held weakly)."""
    _STEP_END.append(weakref.WeakMethod(method))


def subscribe(fn: Subscriber) -> None:
    """Feeds every later event to `fn` (idempotent). `fn` may run on any thread."""
    if fn not in HUB.subscribers:
        HUB.subscribers.append(fn)


def unsubscribe(fn: Subscriber) -> None:
    if fn in HUB.subscribers:
        HUB.subscribers.remove(fn)


def active() -> bool:
    """True when events are wanted (someone subscribed, and publishing is on)."""
    return HUB.active


def set_enabled(flag: bool) -> None:
    """The one switch: False stops all events of this process."""
    HUB.enabled = bool(flag)


def publish(event: dict) -> None:
    """Hands `event` to every subscriber, stamped with the current step if it has none."""
    if not HUB.active:
        return
    event.setdefault("step", HUB.step)
    for fn in list(HUB.subscribers):
        fn(event)


def instant(name: str, label: str, **fields) -> None:
    if HUB.active:
        publish({"type": name, "label": label, "t": time.perf_counter(), **fields})


def compute(label: str, phase: str, start: float, end: float) -> None:
    """A compute span measured by the caller (`phase`: forward, backward, recompute)."""
    if HUB.active:
        publish(
            {
                "type": "compute",
                "label": label,
                "phase": phase,
                "start": start,
                "end": end,
                "t": end,
            }
        )


@contextmanager
def compute_span(label: str, phase: str):
    """Times the body as a compute span, with a `compute_begin` instant first."""
    if not HUB.active:
        yield
        return
    instant("compute_begin", label, phase=phase)
    start = time.perf_counter()
    try:
        yield
    finally:
        compute(label, phase, start, time.perf_counter())


def comm_span(kind: str, label: str, start: float, end: float, nbytes: int, **fields) -> None:
    """A collective from issue to completion (`end_at_wait=True`: end seen at wait)."""
    if HUB.active:
        publish(
            {
                "type": "comm",
                "kind": kind,
                "label": label,
                "start": start,
                "end": end,
                "bytes": int(nbytes),
                "t": end,
                **fields,
            }
        )


def metric(**values) -> None:
    """A training-step metric (loss, lr, loss_scale, grad_norm, val_loss, ...).

    Tensors are converted with `.item()` (one device sync per call, once a step).
    """
    if HUB.active:
        values = {k: (v.item() if hasattr(v, "item") else v) for k, v in values.items()}
        publish({"type": "metric", "t": time.perf_counter(), **values})


def end_step() -> int:
    """Closes the current step (a `step_end` event) and returns the next step's number."""
    alive = [ref for ref in _STEP_END if ref() is not None]
    _STEP_END[:] = alive
    for ref in alive:
        method = ref()
        if method is not None:
            method()
    if HUB.active:
        publish({"type": "step_end", "t": time.perf_counter()})
    HUB.step += 1
    return HUB.step
