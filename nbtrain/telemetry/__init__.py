"""The telemetry layer: per-rank recorder, sinks, step log, overlap metric, report, panels.

The engine (comm, zero, optim) publishes events through `nbtrain.comm.events`;
`init_distributed` (`nbtrain.init_distributed`, the same function as
`nbtrain.comm.init_distributed`) subscribes the recorder to them (`record()`, which this
package adds to the comm layer's `INIT_HOOKS`; importing nbtrain or this package
subscribes nothing). Blocks report compute
spans (per block, forward and backward), the collectives report communication
spans (issue to completion, with bytes) and issue/wait instants, OptimManager
reports step metrics and closes the step, and `sample_memory` adds memory.
Every event carries a sequence number taken from one counter, so the order of
events is exact even when clocks are coarse: tests check the overlap structure
from sequence numbers, not from timings.

Events live in a bounded deque (oldest dropped first) and feed a `StepLog` (the
per-step summary the dashboard and `nbtrain report` draw). `set_enabled(False)`
turns recording off; the hot paths then cost one attribute read. Scripts call
`start(run_dir)` to write one JSONL file per rank; notebook engines publish the
summary to the notebook (`publish_to_notebook`, done when an engine boots).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from ..comm import context, events
from ..comm.events import comm_span, compute_span, instant, metric  # noqa: F401 (public)
from ..comm.renamed import renamed_kwargs
from . import sinks as io
from .steplog import StepLog

# Raw events are for looking at the last few steps (tests, benchmarks clear the log
# and read one step); the history lives in the StepLog and the JSONL files. An event
# dict costs ~500 B, so 10k events are ~5 MB per rank: ~200 steps of a 2-block
# model (46 events a step), ~100 of a 12-block one. (At 50k the recorder alone grew
# a rank's RSS by ~24 MB over the first ~1000 steps of `nbtrain demo`.)
DEFAULT_MAX_EVENTS = 10_000


class Recorder:
    """Bounded, thread-safe event log for one rank."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        self.events: deque = deque(maxlen=max_events)
        self.log = StepLog()
        self._seq = itertools.count()
        self.last_seq = -1
        self._lock = threading.Lock()
        self.sinks: list = []  # callables fed every event (JSONL writer)
        self.progress: dict | None = None  # set by nbtrain.progress on rank 0

    @property
    def step(self) -> int:
        """The step events are recorded under (the engine's step counter)."""
        return events.HUB.step

    def __call__(self, event: dict) -> None:
        """The subscriber: a step's end is preceded by a memory sample of that step."""
        if event["type"] == "step_end":
            self.emit(
                {"type": "memory", "t": event["t"], "step": event["step"], **io.memory_sample()}
            )
        self.emit(event)

    def emit(self, event: dict) -> None:
        # Comm spans arrive from the backend's threads: one lock keeps the deque,
        # the step log and the sinks in sequence order.
        with self._lock:
            event["seq"] = self.last_seq = next(self._seq)
            event.setdefault("step", self.step)
            self.events.append(event)
            self.log.feed(event)
            for sink in self.sinks:
                sink(event)

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    @renamed_kwargs(type="event_type")
    def snapshot(self, event_type: str | None = None) -> list[dict]:
        """The events held, oldest first; with `event_type` only those whose "type"
        field is it (`type=` is the deprecated old keyword)."""
        with self._lock:
            out = list(self.events)
        return out if event_type is None else [e for e in out if e["type"] == event_type]

    def last_metric(self, key: str):
        """The newest value of metric `key` in the step log (None before any)."""
        with self._lock:  # the log is fed from other threads
            return next((m[key] for m in reversed(self.log.metrics) if key in m), None)

    def summary(self, max_points: int | None = 300) -> dict:
        """This rank's StepLog summary plus rank, step and the newest sequence number."""
        with self._lock:
            out = self.log.summary(max_points)
            out.update(
                rank=io.current_rank(),
                host=io.host_name(),
                step=self.step,
                seq=self.last_seq,
                progress=self.progress,
            )
        return out


RECORDER = Recorder()


def record() -> None:
    """Feeds the engine's events to RECORDER from now on (idempotent). Called by
    `init_distributed` (one of the comm layer's `INIT_HOOKS`), and by this package's
    calls that expect a recording (`start`, `watch`, `sample_memory`,
    `publish_to_notebook`)."""
    events.subscribe(RECORDER)


context.INIT_HOOKS.append(record)  # the recorder starts with the run


def enabled() -> bool:
    """True when events are being recorded on this rank: switched on (`set_enabled`)
    and someone subscribed. To put the switch back after changing it, keep
    `nbtrain.comm.events.HUB.enabled`, not this: in a process that never recorded this
    is False, and `set_enabled(False)` then switches events off for good."""
    return events.active()


def set_enabled(flag: bool) -> None:
    """The one switch: False stops all recording on this rank."""
    events.set_enabled(flag)


def next_step() -> int:
    """Closes the current step (with a memory sample) and advances the step counter."""
    return events.end_step()


def watch(model=None, optimizer=None) -> None:
    """Count `model`'s parameters and grads and `optimizer`'s state in memory samples.

    Held by weak reference: watching keeps nothing alive. The model's unsharded size
    is counted once here (call `watch` again after changing the model).
    """
    record()
    io.WATCHED.set(model, optimizer)


def sample_memory(model=None, optimizer=None) -> dict:
    """Records one memory sample of this rank and returns it.

    CUDA allocated/reserved/peak bytes when CUDA is in use; process RSS; and the
    bytes this rank holds of `model`/`optimizer` (or of those given to `watch`):
    `param_bytes` (parameter shards), `grad_bytes`, `optimizer_bytes` and their sum
    `model_state_bytes`; and with `watch(model)`, `full_param_bytes`, the whole model's
    parameters unsharded. One sample closes every step, so the panels draw memory over
    time.
    """
    record()
    sample = io.memory_sample(model, optimizer)
    if events.active():
        RECORDER.emit({"type": "memory", "t": time.perf_counter(), **sample})
    return sample


def start(run_dir=None) -> str:
    """Write this rank's events to `run_dir/rank<r>.jsonl` (for scripts under torchrun).

    `run_dir` defaults to $NBTRAIN_RUN_DIR. Turns recording on. Returns the file path.
    """
    writer = io.JsonlWriter.open(run_dir)
    stop()
    set_enabled(True)
    record()
    RECORDER.sinks.append(writer)
    RECORDER.emit({"type": "meta", "t": time.perf_counter(), **io.meta()})
    return writer.path


def stop() -> None:
    """Flush and close the JSONL files that `start` opened."""
    with RECORDER._lock:
        writers = [s for s in RECORDER.sinks if isinstance(s, io.JsonlWriter)]
        RECORDER.sinks = [s for s in RECORDER.sinks if s not in writers]
    for writer in writers:
        writer.close()


def gathered_peak(events: list[dict] | None = None) -> int:
    """Most blocks gathered at once in `events` (default: the recorder's).

    Read from the `gather` / `release` events of each block's flat groups, whose
    labels are "<block label>.<group index>". ZeRO-3 keeps it at 2 (the block
    computing and the one prefetched); ZeRO-2 keeps every block until backward.
    """
    events = RECORDER.snapshot() if events is None else events
    live: dict[str, set] = {}
    peak = 0
    for event in events:
        if event["type"] not in ("gather", "release"):
            continue
        block, _, group = event["label"].rpartition(".")
        groups = live.setdefault(block, set())
        if event["type"] == "gather":
            groups.add(group)
        else:
            groups.discard(group)
        if not groups:
            del live[block]
        peak = max(peak, len(live))
    return peak


def summary() -> dict:
    """This rank's summary (what the dashboard draws): memory, last step, metrics."""
    return RECORDER.summary()


def publish_to_notebook(interval_s: float = 0.25) -> None:
    """On an ipyparallel engine: publish `RECORDER.summary()` while cells run.

    At most once per `interval_s`, only when something new was recorded, and once
    more when each cell ends. Safe to call twice.
    """
    record()
    io.start_publisher(RECORDER, interval_s)
