"""Per-rank telemetry recorder: compute spans, communication spans, metrics.

Block and TransformerBlockList report compute spans (per block, forward and
backward), the collectives module reports communication spans (issue to
completion, with bytes) and issue/wait instants, and the optimizer layer reports
step metrics. Every event carries a sequence number taken from one counter, so
the order of events is exact even when clocks are coarse: tests check the
overlap structure from sequence numbers, not from timings.

Events live in a bounded deque (oldest dropped first). `set_enabled(False)` turns
recording off; the hot paths then cost one attribute read.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager

DEFAULT_MAX_EVENTS = 200_000


class Recorder:
    """Bounded, thread-safe event log for one rank."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        self.enabled = True
        self.events: deque = deque(maxlen=max_events)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.step = 0
        self.sinks: list = []  # callables fed every event (JSONL writer, publisher)

    def emit(self, event: dict) -> None:
        event["seq"] = next(self._seq)
        event.setdefault("step", self.step)
        with self._lock:
            self.events.append(event)
        for sink in self.sinks:
            sink(event)

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def snapshot(self, type: str | None = None) -> list[dict]:  # noqa: A002 (event field name)
        with self._lock:
            events = list(self.events)
        return events if type is None else [e for e in events if e["type"] == type]


RECORDER = Recorder()


def enabled() -> bool:
    return RECORDER.enabled


def set_enabled(flag: bool) -> None:
    """The one switch: False stops all recording on this rank."""
    RECORDER.enabled = bool(flag)


def instant(name: str, label: str, **fields) -> None:
    if RECORDER.enabled:
        RECORDER.emit({"type": name, "label": label, "t": time.perf_counter(), **fields})


@contextmanager
def compute_span(label: str, phase: str):
    """Times a block's compute; `phase` is "forward", "backward" or "recompute"."""
    if not RECORDER.enabled:
        yield
        return
    RECORDER.emit({"type": "compute_begin", "label": label, "phase": phase,
                   "t": time.perf_counter()})
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        RECORDER.emit({"type": "compute", "label": label, "phase": phase,
                       "start": start, "end": end, "t": end})


def comm_span(kind: str, label: str, start: float, end: float, nbytes: int) -> None:
    if RECORDER.enabled:
        RECORDER.emit({"type": "comm", "kind": kind, "label": label, "start": start,
                       "end": end, "bytes": int(nbytes), "t": end})


def metric(**values) -> None:
    """A training-step metric (loss, lr, loss_scale, grad_norm, step_time_s...)."""
    if RECORDER.enabled:
        RECORDER.emit({"type": "metric", "t": time.perf_counter(), **values})


def next_step() -> int:
    RECORDER.step += 1
    return RECORDER.step
