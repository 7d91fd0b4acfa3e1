"""nbtrain.debug.detect_nonfinite at 2 ranks: an Inf made on rank 1 at step 3 in forward,
and one made only in backward at step 2, are reported as that module, rank, step and
direction on every rank; switched off, no hook is installed; the origin reaches
telemetry, and the dashboard's loss panel marks its step."""

import pytest
from nonfinite_cases import after_training, origins
from support.ranks import run_ranks


@pytest.fixture(scope="module")
def nonfinite_runs():
    return run_ranks(origins, 2, timeout_s=180)


def test_forward_inf_is_reported_with_module_rank_step_direction(nonfinite_runs):
    for out in nonfinite_runs:  # the same answer on every rank
        assert out["forward"] == (3, "2", 1, "forward"), out
    # Rank 1 saw it first; rank 0 only once the NaN weights came back at step 4.
    assert nonfinite_runs[1]["forward_local"][0] == (3, "2", 1, "forward"), nonfinite_runs[1]
    assert nonfinite_runs[0]["forward_local"][0][0] == 4, nonfinite_runs[0]
    # Two hooks per module (forward, full backward) while on, none left after the block.
    assert all(
        o["forward_hooks_added"] >= 8 and o["forward_hooks_left"] == 0 for o in nonfinite_runs
    )


def test_backward_only_inf_is_reported_as_backward(nonfinite_runs):
    for out in nonfinite_runs:
        assert out["backward"] == (2, "2", 1, "backward"), out
    assert nonfinite_runs[1]["backward_local"][0] == (2, "2", 1, "backward"), nonfinite_runs[1]


def test_off_installs_nothing_and_reports_nothing(nonfinite_runs):
    for out in nonfinite_runs:
        assert out["off_hooks_added"] == 0 and out["off_report"] is None, out


def test_origin_is_published_for_the_dashboard(nonfinite_runs):
    # Each rank publishes its own first origin of each step: rank 1 at step 3, rank 0
    # at step 4 (the NaN weights); the dashboard marks both steps.
    assert nonfinite_runs[1]["forward_events"][0] == (3, "2", "forward", 1), nonfinite_runs[1]
    assert (
        nonfinite_runs[1]["forward_marks"][0] == 3 and nonfinite_runs[0]["forward_marks"][0] == 4
    ), nonfinite_runs
    assert nonfinite_runs[1]["backward_events"][0] == (2, "2", "backward", 1), nonfinite_runs[1]


def test_loss_panel_marks_the_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nbtrain.telemetry.panels_train import NONFINITE_COLOR, draw_loss

    metrics = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(5)]
    fig, ax = plt.subplots()
    draw_loss(
        ax, {0: {"metrics": metrics}, 1: {"metrics": metrics[:3] + [{"step": 3, "nonfinite": 1.0}]}}
    )
    marks = [line for line in ax.get_lines() if line.get_color() == NONFINITE_COLOR]
    assert [tuple(line.get_xdata()) for line in marks] == [(3, 3)]
    plt.close(fig)


def test_steps_count_from_the_watch_not_the_process():
    runs = run_ranks(after_training, 2, timeout_s=180)
    for out in runs:
        assert out["origin"] == (1, "2", 1, "forward"), out
        assert out["process_step"] == 7, out
    assert runs[1]["marks"][0] == 5, runs[1]  # the dashboard's step of the same origin
