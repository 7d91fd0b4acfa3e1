"""Per-step summary of one rank's events: what the dashboard and the report draw.

`StepLog.feed` takes recorder events one at a time, live (from the recorder) or
replayed (from a rank's JSONL file), so the notebook and `nbtrain report` show
the same numbers. Everything it keeps is bounded.
"""
from __future__ import annotations

from collections import deque

from .overlap import comm_overlap, total

METRIC_KEYS = ("loss", "lr", "loss_scale", "grad_norm", "skipped", "step_time_s")
MEMORY_KEYS = ("cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_peak_bytes",
               "rss_bytes", "model_state_bytes")
MAX_SPANS_PER_STEP = 2000   # spans kept for the timeline of the open step
MAX_TIMELINE_SPANS = 400    # spans sent to the dashboard for the last step
DEFAULT_HISTORY = 2000      # steps of metrics and overlap kept


class StepLog:
    """Aggregates events into: latest memory, last step's timeline, metric history.

    Not thread-safe by itself; the recorder feeds it under its lock.
    """

    def __init__(self, history: int = DEFAULT_HISTORY):
        self.metrics: deque = deque(maxlen=history)
        self.overlap: deque = deque(maxlen=history)
        self.memory: dict = {}
        self.peak_memory: dict = {}
        self.last_step: dict | None = None
        self.meta: dict = {}
        self._spans: list = []
        self._step_start: float | None = None

    def feed(self, event: dict) -> None:
        kind = event["type"]
        if kind in ("compute", "comm"):
            closed = self.last_step["step"] if self.last_step else None
            if closed is not None and event.get("step", 0) <= closed:
                return  # completed after its step was summarised: too late to count
            if len(self._spans) < MAX_SPANS_PER_STEP:
                self._spans.append(event)
        elif kind == "metric":
            row = {k: event[k] for k in METRIC_KEYS if k in event}
            row["step"] = event.get("step", 0)
            self.metrics.append(row)
        elif kind == "memory":
            self.memory = {k: event[k] for k in MEMORY_KEYS if event.get(k) is not None}
            for k, v in self.memory.items():
                self.peak_memory[k] = max(v, self.peak_memory.get(k, 0))
        elif kind == "step_end":
            self._close_step(event)
        elif kind == "meta":
            self.meta = {k: v for k, v in event.items() if k not in ("type", "seq")}

    def _close_step(self, event: dict) -> None:
        spans, self._spans = self._spans, []
        end = event["t"]
        starts = [s["start"] for s in spans]
        t0 = self._step_start if self._step_start is not None else min(starts, default=end)
        self._step_start = end
        comm = [(s["start"], s["end"]) for s in spans if s["type"] == "comm"]
        compute = [(s["start"], s["end"]) for s in spans if s["type"] == "compute"]
        share = comm_overlap(comm, compute)
        step = event.get("step", 0)
        self.overlap.append((step, share))
        timeline = spans[-MAX_TIMELINE_SPANS:]
        self.last_step = {
            "step": step, "duration_s": end - t0, "overlap": share,
            "comm_s": total(comm), "compute_s": total(compute),
            "comm_bytes": sum(s["bytes"] for s in spans if s["type"] == "comm"),
            "compute": [[s["start"] - t0, s["end"] - t0, s["label"], s.get("phase", "")]
                        for s in timeline if s["type"] == "compute"],
            "comm": [[s["start"] - t0, s["end"] - t0, s["kind"], s["bytes"]]
                     for s in timeline if s["type"] == "comm"],
        }

    def summary(self, max_points: int | None = None) -> dict:
        """A plain, JSON-able dict: what a rank publishes and what the panels draw."""
        metrics, overlap = list(self.metrics), list(self.overlap)
        if max_points is not None:
            metrics, overlap = metrics[-max_points:], overlap[-max_points:]
        return {"meta": dict(self.meta), "memory": dict(self.memory),
                "peak_memory": dict(self.peak_memory), "last_step": self.last_step,
                "metrics": metrics, "overlap": overlap}
