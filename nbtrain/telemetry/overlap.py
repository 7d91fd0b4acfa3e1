"""The overlap metric: the share of communication time covered by compute time.

The definition is Holistic Trace Analysis's comm/comp overlap
(`hta.analyzers.breakdown_analysis.get_comm_comp_overlap`): merge the
communication intervals of one rank and one step into a union, merge the compute
intervals into a union, and divide the length of their intersection by the
length of the communication union. 1.0 means every second spent communicating
was hidden behind compute; 0.0 means none was.

Pure functions on `(start, end)` pairs, so the same numbers come from a live
recorder, from a JSONL file and from hand-built spans in the unit tests.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of `intervals`."""
    return sum(e - s for s, e in merge(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of (union of a) intersected with (union of b): a two-pointer sweep."""
    a, b = merge(a), merge(b)
    i = j = 0
    covered = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            covered += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return covered


def comm_overlap(comm: Iterable[Interval], compute: Iterable[Interval]) -> float | None:
    """Share of communication time hidden behind compute, in [0, 1].

    Args:
        comm: (start_s, end_s) of each collective, issue to completion.
        compute: (start_s, end_s) of each compute span.

    Returns:
        |union(comm) & union(compute)| / |union(comm)|, or None when there was no
        communication (a share of nothing is undefined, not 0 or 1).
    """
    comm = merge(comm)
    comm_s = sum(e - s for s, e in comm)
    if comm_s <= 0:
        return None
    return intersection(comm, compute) / comm_s
