"""Per-step summary of one rank's events: what the dashboard and the report draw.

`StepLog.feed` takes recorder events one at a time, live (from the recorder) or
replayed (from a rank's JSONL file), so the notebook and `nbtrain report` show
the same numbers. Everything it keeps is bounded.

Per step it keeps: the metric row (loss, lr, grad_norm, tokens, and any number a
user passes to `telemetry.metric`), the hidden-comm share, the step's wall time
and the bytes and busy seconds of each kind of collective, and the last memory
sample of the step.
"""

from __future__ import annotations

from .overlap import comm_overlap, merge, total

MEMORY_KEYS = (
    "cuda_allocated_bytes",
    "cuda_reserved_bytes",
    "cuda_peak_bytes",
    "rss_bytes",
    "model_state_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "full_param_bytes",
)
NOT_METRICS = frozenset(("type", "t", "seq", "step"))
MAX_METRIC_NAMES = 32  # numbers kept per metric row (a runaway dict stays bounded)
MAX_ROUTING_NAMES = 256  # MoE layers' "moe.<i>.balance"/".dropped": two per layer
MAX_SPANS_PER_STEP = 2000  # spans kept for the timeline of the open step
MAX_TIMELINE_SPANS = 400  # spans sent to the dashboard for the last step
# Rows of metrics, overlap, step times and memory kept per rank, spanning the whole run
# (`History`). A row is ~0.4 KB: 4 histories of 1000 are ~1.6 MB a rank, and as much
# per rank in the notebook's dashboard. (At 2000 kept, a rank grew 2.6 MB and the
# notebook 9.6 MB at 3 ranks between cell 100 and 500 of 4-step cells, as they filled.)
DEFAULT_HISTORY = 1000
IDLE_GAP_S = 1.0  # a pause before a step's first event longer than this (and
# than the step itself) is idle time between cells, not the step


def _step_of(row) -> int:
    return row["step"] if isinstance(row, dict) else row[0]


def thin(rows, cap: int) -> list:
    """`rows` (step-sorted) cut to at most `cap`: the newest half of `cap` stays whole;
    of the older rows, those whose step is a multiple of the smallest power of two that
    leaves at most a quarter of `cap`. A row kept at one stride is kept at the next, so
    the curves' older points stay put as the run grows, and they span the whole run."""
    rows = list(rows)
    if len(rows) <= cap:
        return rows
    dense = cap // 2
    older, newest = rows[:-dense], rows[-dense:]
    stride = 2
    while True:
        kept = [r for r in older if _step_of(r) % stride == 0]
        if len(kept) <= max(cap // 4, 1):
            return kept + newest
        stride *= 2


class History:
    """At most `cap` rows, oldest first: the newest half of `cap` whole, the older rows
    thinned by step (`thin`), so the curves of a 20,000-step cell still start at its
    first step while the memory stays bounded. A deque's `append`, `[-1]`, `len` and
    iteration."""

    def __init__(self, cap: int):
        self.maxlen = max(int(cap), 4)
        self._rows: list = []

    def append(self, row) -> None:
        self._rows.append(row)
        if len(self._rows) > self.maxlen:
            self._rows = thin(self._rows, self.maxlen)

    def clear(self) -> None:
        self._rows.clear()

    def __getitem__(self, i):
        return self._rows[i]

    def __setitem__(self, i, row) -> None:
        self._rows[i] = row

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)


class StepLog:
    """Aggregates events into per-step rows, memory history and the last step's timeline.

    Not thread-safe by itself; the recorder feeds it under its lock.
    """

    def __init__(self, history: int = DEFAULT_HISTORY):
        self.metrics = History(history)
        self.overlap = History(history)
        self.steps = History(history)
        self.memory_history = History(history)
        self.memory: dict = {}
        self.peak_memory: dict = {}
        self.last_step: dict | None = None
        self.meta: dict = {}
        self._spans: list = []
        self._step_start: float | None = None  # the previous step's end
        self._first_t: float | None = None  # the open step's first timestamp

    def feed(self, event: dict) -> None:
        kind = event["type"]
        if self._first_t is None:
            self._first_t = event.get("start", event.get("t"))
        if kind in ("compute", "comm"):
            closed = self.last_step["step"] if self.last_step else None
            if closed is not None and event.get("step", 0) <= closed:
                return  # completed after its step was summarised: too late to count
            if len(self._spans) < MAX_SPANS_PER_STEP:
                self._spans.append(event)
        elif kind == "metric":
            self._add_metrics(event)
        elif kind == "memory":
            self._add_memory(event)
        elif kind == "step_end":
            self._close_step(event)
        elif kind == "meta":
            self.meta = {k: v for k, v in event.items() if k not in ("type", "seq")}

    def _add_metrics(self, event: dict) -> None:
        """One row per step: a second `metric` call in a step adds to the first's row."""
        step = event.get("step", 0)
        if self.metrics and self.metrics[-1]["step"] == step:
            row = self.metrics[-1]
        else:
            row = {"step": step}
            self.metrics.append(row)
        for k, v in event.items():
            if k in NOT_METRICS or not isinstance(v, (int, float)):
                continue
            if k in row:
                row[k] = v
            elif k.startswith("moe."):  # routing: bounded by the model's depth, apart
                routing = sum(name.startswith("moe.") for name in row)
                if routing < MAX_ROUTING_NAMES:
                    row[k] = v
            elif sum(not name.startswith("moe.") for name in row) <= MAX_METRIC_NAMES:
                row[k] = v

    def _add_memory(self, event: dict) -> None:
        self.memory = {k: event[k] for k in MEMORY_KEYS if event.get(k) is not None}
        for k, v in self.memory.items():
            self.peak_memory[k] = max(v, self.peak_memory.get(k, 0))
        row = {"step": event.get("step", 0), **self.memory}
        if self.memory_history and self.memory_history[-1]["step"] == row["step"]:
            # The step's last sample stands for it, keeping what only an earlier one
            # counted (a sample taken with the model beside the step's own).
            self.memory_history[-1] = {**self.memory_history[-1], **row}
        else:
            self.memory_history.append(row)

    def _close_step(self, event: dict) -> None:
        spans, self._spans = self._spans, []
        end, first = event["t"], self._first_t
        self._first_t = None
        t0 = self._step_start
        if t0 is None or first is not None and first - t0 > max(IDLE_GAP_S, end - first):
            t0 = min([s["start"] for s in spans] + [first if first is not None else end])
        self._step_start = end
        comm = [(s["start"], s["end"]) for s in spans if s["type"] == "comm"]
        compute = [(s["start"], s["end"]) for s in spans if s["type"] == "compute"]
        share = comm_overlap(comm, compute)
        step = event.get("step", 0)
        self.overlap.append((step, share))
        self.steps.append({"step": step, "duration_s": end - t0, "comm": _by_kind(spans)})
        timeline = spans[-MAX_TIMELINE_SPANS:]
        self.last_step = {
            "step": step,
            "duration_s": end - t0,
            "overlap": share,
            "comm_s": total(comm),
            "compute_s": total(compute),
            "comm_bytes": sum(s["bytes"] for s in spans if s["type"] == "comm"),
            "compute": [
                [s["start"] - t0, s["end"] - t0, s["label"], s.get("phase", "")]
                for s in timeline
                if s["type"] == "compute"
            ],
            "comm": [
                [s["start"] - t0, s["end"] - t0, s["kind"], s["bytes"]]
                for s in timeline
                if s["type"] == "comm"
            ],
        }

    def summary(self, max_points: int | None = None) -> dict:
        """A plain, JSON-able dict: what a rank publishes and what the panels draw."""
        out = {
            "meta": dict(self.meta),
            "memory": dict(self.memory),
            "peak_memory": dict(self.peak_memory),
            "last_step": self.last_step,
        }
        for key in ("metrics", "overlap", "steps", "memory_history"):
            rows = list(getattr(self, key))
            out[key] = rows if max_points is None else rows[-max_points:]
        out["metrics"] = [dict(m) for m in out["metrics"]]  # rows still grow in place
        return out


def _by_kind(spans: list) -> dict:
    """{kind: [bytes, busy seconds]} of a step's collectives (busy: union of spans)."""
    out: dict = {}
    for s in spans:
        if s["type"] == "comm":
            out.setdefault(s["kind"], [0, []])
            out[s["kind"]][0] += s["bytes"]
            out[s["kind"]][1].append((s["start"], s["end"]))
    return {k: [n, sum(e - s for s, e in merge(iv))] for k, (n, iv) in out.items()}
