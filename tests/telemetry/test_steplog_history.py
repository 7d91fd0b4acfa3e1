"""StepLog's per-step history: metric rows, step time, comm by kind, memory over time."""

import pytest

from nbtrain.telemetry.steplog import History, StepLog


def _step(log, step, t0, gap_s=0.0, **metrics):
    """A step of 1 s starting `gap_s` after t0: two gathers that overlap, one reduce."""
    t = t0 + gap_s
    for kind, start, end, nbytes in (
        ("all_gather", 0.0, 0.4, 100),
        ("all_gather", 0.2, 0.6, 100),
        ("reduce_scatter", 0.7, 0.9, 50),
    ):
        log.feed(
            {
                "type": "comm",
                "kind": kind,
                "label": "b",
                "start": t + start,
                "end": t + end,
                "bytes": nbytes,
                "t": t + end,
                "step": step,
            }
        )
    log.feed({"type": "metric", "loss": 2.0, "t": t + 1, "step": step, **metrics})
    log.feed(
        {
            "type": "memory",
            "t": t + 1,
            "step": step,
            "rss_bytes": 10 + step,
            "param_bytes": 3,
            "grad_bytes": 2,
            "optimizer_bytes": 6,
            "model_state_bytes": 11,
        }
    )
    log.feed({"type": "step_end", "t": t + 1, "step": step})
    return t + 1


def test_rows_per_step_with_user_metrics_comm_and_memory():
    log = StepLog()
    t = _step(log, 0, 0.0, tokens=64)
    log.feed({"type": "metric", "val_loss": 2.5, "note": "text is dropped", "t": t, "step": 1})
    _step(log, 1, t, tokens=64, accuracy=0.5)
    s = log.summary()
    assert s["metrics"] == [
        {"step": 0, "loss": 2.0, "tokens": 64},
        {"step": 1, "val_loss": 2.5, "loss": 2.0, "tokens": 64, "accuracy": 0.5},
    ]
    assert [r["duration_s"] for r in s["steps"]] == [pytest.approx(1.0), pytest.approx(1.0)]
    comm = s["steps"][1]["comm"]
    # Bytes add up; busy time is the union of a kind's spans (0.0-0.6, not 0.8).
    assert comm["all_gather"] == [200, pytest.approx(0.6)]
    assert comm["reduce_scatter"] == [50, pytest.approx(0.2)]
    assert [m["rss_bytes"] for m in s["memory_history"]] == [10, 11]
    assert s["memory_history"][1]["optimizer_bytes"] == 6
    assert s["peak_memory"]["rss_bytes"] == 11


def test_idle_time_between_cells_is_not_step_time():
    log = StepLog()
    t = _step(log, 0, 0.0)
    _step(log, 1, t, gap_s=30.0)  # the next cell ran half a minute later
    assert log.summary()["steps"][1]["duration_s"] == pytest.approx(1.0)
    assert log.last_step["compute"] == [] and log.last_step["comm"][0][0] == pytest.approx(0.0)


def test_history_is_bounded():
    log = StepLog(history=5)
    t = 0.0
    for step in range(8):
        t = _step(log, step, t)
    s = log.summary(max_points=3)
    assert [m["step"] for m in s["metrics"]] == [5, 6, 7]
    assert len(log.steps) == len(log.memory_history) == len(log.metrics) == 5


def test_a_long_runs_history_spans_it_thinned_where_older_and_stays_bounded():
    """20,000 steps in 1000 rows: the newest 500 steps whole, the older every 128th
    step from the first (a loss curve still starts at step 0), and a row kept once
    stays kept as the run grows (the curves' older points do not move)."""
    history = History(1000)
    seen = {}
    for step in range(20_000):
        history.append({"step": step})
        if step in (5_000, 19_999):
            seen[step] = [r["step"] for r in history]
    steps = seen[19_999]
    assert len(steps) <= 1000 and steps[0] == 0 and steps[-500:] == list(range(19_500, 20_000))
    assert max(b - a for a, b in zip(steps, steps[1:])) == 128
    older = [s for s in steps if s < 5_000 - 500]
    assert set(older) <= set(seen[5_000])


def test_routing_metrics_of_a_deep_moe_are_kept_and_user_metrics_stay_bounded():
    log = StepLog()
    for i in range(40):  # 40 MoE layers: 80 routing names, more than the user-metric cap
        log.feed(
            {
                "type": "metric",
                f"moe.{i}.balance": 1.5,
                f"moe.{i}.dropped": 0.0,
                "t": 0.0,
                "step": 0,
            }
        )
    log.feed({"type": "metric", "t": 0.0, "step": 0, **{f"user{j}": float(j) for j in range(100)}})
    row = log.summary()["metrics"][0]
    assert sum(k.startswith("moe.") for k in row) == 80
    assert 30 <= sum(k.startswith("user") for k in row) <= 33  # the cap still holds
