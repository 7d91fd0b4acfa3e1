"""Hidden communication: the share of comm time covered by compute time.

Holistic Trace Analysis defines comm/comp overlap as the time communication
runs while computation also runs, over the total communication time. Both sides
are unions of intervals (concurrent collectives count once). Here intervals come
from nbtrain.telemetry: "comm" events (issue to completion) and "compute" events
(block forward and backward); work outside blocks (embedding, head, loss,
optimizer) has no compute span, so comm under it counts as exposed: the figure
is a lower bound.
"""
from __future__ import annotations


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_fraction(events: list[dict]) -> float | None:
    """Fraction in [0, 1] of comm time overlapped by compute; None without comm."""
    comm = _union([(e["start"], e["end"]) for e in events if e["type"] == "comm"])
    compute = _union([(e["start"], e["end"]) for e in events if e["type"] == "compute"])
    total = _length(comm)
    if total <= 0:
        return None
    return _intersect(comm, compute) / total
