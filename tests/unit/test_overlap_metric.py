"""The overlap metric on hand-built spans (HTA's comm/comp overlap)."""

import pytest

from nbtrain.telemetry.overlap import comm_overlap, intersection, merge, total
from nbtrain.telemetry.steplog import StepLog


def test_no_overlap_is_zero():
    assert comm_overlap([(0.0, 1.0)], [(1.0, 2.0), (3.0, 4.0)]) == 0.0


def test_half_hidden_is_half():
    assert comm_overlap([(0.0, 2.0)], [(1.0, 3.0)]) == pytest.approx(0.5)
    # Two collectives in flight at once count once (union), as in HTA.
    assert comm_overlap([(0.0, 2.0), (0.5, 1.5)], [(1.0, 5.0)]) == pytest.approx(0.5)


def test_fully_hidden_is_one():
    # Compute made of two adjacent spans still covers the whole collective.
    assert comm_overlap([(1.0, 2.0), (3.0, 3.5)], [(0.0, 1.5), (1.5, 4.0)]) == 1.0


def test_no_communication_is_undefined():
    assert comm_overlap([], [(0.0, 1.0)]) is None
    assert comm_overlap([(1.0, 1.0)], [(0.0, 2.0)]) is None


def test_interval_helpers():
    assert merge([(2, 3), (0, 1), (0.5, 2.5), (5, 5)]) == [(0, 3)]
    assert total([(0, 1), (0.5, 2), (4, 5)]) == 3
    assert intersection([(0, 10)], [(1, 2), (3, 4), (9, 12)]) == 3


def test_steplog_reports_the_metric_per_step():
    log = StepLog()
    spans = [("comm", 0.0, 2.0), ("compute", 1.0, 3.0)]  # step 0: 50 %
    for kind, s, e in spans:
        log.feed(
            {
                "type": kind,
                "label": "b0",
                "phase": "forward",
                "kind": "all_gather",
                "bytes": 8,
                "start": s,
                "end": e,
                "step": 0,
            }
        )
    log.feed({"type": "metric", "loss": 2.5, "lr": 0.1, "step": 0})
    log.feed({"type": "step_end", "t": 3.0, "step": 0})
    log.feed(
        {
            "type": "comm",
            "kind": "reduce_scatter",
            "label": "b0",
            "bytes": 8,
            "start": 4.0,
            "end": 5.0,
            "step": 1,
        }
    )
    log.feed({"type": "step_end", "t": 6.0, "step": 1})  # step 1: no compute, 0 %
    summary = log.summary()
    assert [o for _, o in summary["overlap"]] == [pytest.approx(0.5), 0.0]
    assert summary["last_step"]["step"] == 1 and summary["last_step"]["comm_bytes"] == 8
    assert summary["metrics"][0]["loss"] == 2.5
