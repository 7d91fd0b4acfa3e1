"""Overlap is structural: checked from the order of recorded events, not timings."""

from support import cases
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain import telemetry


def _one_step_events(zero_level):
    model = cases.sharded_model("blocklist", zero_level, False)
    labels = [b.label for b in model.layers]
    xs, ys = cases.batches(nbt.world_size(), 1)
    model.loss(xs[0, :2], ys[0, :2]).backward()  # warm-up step, not recorded
    telemetry.RECORDER.clear()
    model.loss(xs[0, :2], ys[0, :2]).backward()
    events = telemetry.RECORDER.snapshot()
    return labels, events, telemetry.gathered_peak(events)


def _first(events, **match):
    for e in events:
        if all(e.get(k) == v for k, v in match.items()):
            return e
    raise AssertionError(f"no event matching {match}")


def _check(labels, events):
    bwd_start = _first(events, type="compute_begin", phase="backward")["seq"]
    fwd = [e for e in events if e["seq"] < bwd_start]
    bwd = [e for e in events if e["seq"] >= bwd_start]
    for i in range(len(labels) - 1):
        cur, nxt = labels[i], labels[i + 1]
        begin = _first(fwd, type="compute_begin", label=cur, phase="forward")["seq"]
        end = _first(fwd, type="compute", label=cur, phase="forward")["seq"]
        issue = _first(fwd, type="comm_issue", label=nxt + ".0", kind="all_gather")["seq"]
        wait = _first(fwd, type="comm_wait", label=nxt + ".0", kind="all_gather")["seq"]
        assert issue < begin, f"forward: gather of {nxt} issued after {cur} began computing"
        assert wait > end, f"forward: gather of {nxt} waited before {cur} finished"
        rs = _first(bwd, type="comm_issue", label=nxt + ".0", kind="reduce_scatter")["seq"]
        bbegin = _first(bwd, type="compute_begin", label=cur, phase="backward")["seq"]
        assert rs < bbegin, f"backward: reduce-scatter of {nxt} issued after {cur} began"
    # Backward prefetch: block i-1's gather is issued when block i starts backward.
    for i in range(1, len(labels)):
        bbegin = _first(bwd, type="compute_begin", label=labels[i], phase="backward")["seq"]
        issue = _first(bwd, type="comm_issue", label=labels[i - 1] + ".0", kind="all_gather")
        prev_begin = _first(bwd, type="compute_begin", label=labels[i - 1], phase="backward")
        assert bbegin < issue["seq"] < prev_begin["seq"]


def test_zero3_prefetch_and_reduce_scatter_order():
    for labels, events, peak in run_ranks(_one_step_events, 2, 3):
        _check(labels, events)
        assert peak <= 2, f"{peak} blocks gathered at once under ZeRO-3"
        comm = [e for e in events if e["type"] == "comm"]
        assert comm and all(e["end"] >= e["start"] and e["bytes"] > 0 for e in comm)


def test_zero2_keeps_blocks_gathered_until_backward():
    for labels, events, peak in run_ranks(_one_step_events, 2, 2):
        bwd_start = _first(events, type="compute_begin", phase="backward")["seq"]
        gathers_in_backward = [
            e
            for e in events
            if e["seq"] > bwd_start and e["type"] == "comm_issue" and e["kind"] == "all_gather"
        ]
        assert gathers_in_backward == []
        assert peak == len(labels)
