"""A cell's last dashboard picture is drawn in the background: the cell does not wait
for matplotlib (2-5 s a picture on a loaded 2-core machine made a 0.5 s cell take
5.5 s with the dashboard shown), and the last summaries are still the ones drawn."""

import threading
import time

import pytest

pytest.importorskip("ipywidgets")
from nbtrain.notebook import dashboard


def summary(seq: int, loss: float) -> dict:
    return {
        "seq": seq,
        "step": seq,
        "metrics": [{"step": seq, "loss": loss}],
        "overlap": [],
        "steps": [],
        "memory_history": [],
    }


def test_final_update_returns_before_the_picture_and_the_last_one_is_drawn(monkeypatch):
    release, drawn = threading.Event(), []

    def slow_png(summaries, **picture):
        release.wait(30)  # a picture that takes as long as the test wants
        drawn.append(summaries[0]["metrics"][-1]["loss"])
        return b"\x89PNG"

    monkeypatch.setattr(dashboard, "png_bytes", slow_png)
    board = dashboard.Dashboard(redraw_s=0.0)
    start = time.monotonic()
    board.update({0: summary(1, 4.0)}, final=True)  # the end of one cell
    board.update({0: summary(2, 3.0)}, final=True)  # the next cell, while still drawing
    board.update({0: summary(3, 2.0)}, final=True)  # and the one after it
    assert time.monotonic() - start < 1.0 and drawn == []  # nothing waited for the drawing
    assert "2.0000" in board.header.value  # the numbers are current at once
    release.set()
    board.wait_drawn(30)
    assert drawn == [4.0, 2.0] and board.redraws == 2  # the newest queued picture, once
    board.update({0: summary(4, 1.0)}, final=True)
    board.wait_drawn(30)
    assert drawn[-1] == 1.0 and board.image.value == b"\x89PNG"


def test_a_failed_picture_does_not_stop_later_ones(monkeypatch):
    calls = []

    def flaky_png(summaries, **picture):
        calls.append(picture["dpi"])
        if len(calls) == 1:
            raise ValueError("a bad figure")
        return b"\x89PNG"

    monkeypatch.setattr(dashboard, "png_bytes", flaky_png)
    board = dashboard.Dashboard(redraw_s=0.0)
    board.update({0: summary(1, 4.0)}, final=True)
    with pytest.raises(ValueError):
        board.wait_drawn(30)
    board.update({0: summary(2, 3.0)}, final=True)
    board.wait_drawn(30)
    assert len(calls) == 2 and board.redraws == 1


def test_a_new_dashboard_and_stop_wait_for_the_last_picture(monkeypatch, capsys):
    # `%nbtrain stop` right after a cell shut the engines (and, in a notebook run by
    # nbclient, the kernel) down while the cell's last picture was still drawing: the
    # saved notebook kept an empty image.
    release = threading.Event()

    def slow_png(summaries, **picture):
        release.wait(30)
        return b"\x89PNG" + bytes([summaries[0]["seq"]])

    monkeypatch.setattr(dashboard, "png_bytes", slow_png)
    monkeypatch.setattr(dashboard, "_CURRENT", None)
    old = dashboard.Dashboard(redraw_s=0.0).show()
    old.update({0: summary(7, 4.0)}, final=True)
    threading.Timer(0.5, release.set).start()
    began = time.monotonic()
    new = dashboard.Dashboard(redraw_s=0.0).show()  # `%nbtrain dashboard` after the cell
    assert time.monotonic() - began >= 0.4 and old.image.value == b"\x89PNG\x07"
    assert dashboard.current() is new

    release.clear()
    new.update({0: summary(8, 3.0)}, final=True)
    threading.Timer(0.5, release.set).start()
    dashboard.settle()  # what `%nbtrain stop` does first
    assert new.image.value == b"\x89PNG\x08"

    release.clear()  # a picture that never finishes: settle gives up and says so
    new.update({0: summary(9, 2.0)}, final=True)
    dashboard.settle(0.3)
    assert "last picture is not drawn after 0.3 s" in capsys.readouterr().out
    release.set()
    new.wait_drawn(30)


def test_a_dashboard_for_one_cell_shows_that_cells_steps_only(monkeypatch):
    # A re-run of a training cell: the ranks' histories still hold the last run's steps
    # (0-29); the cell began at step 30, which every publication of the cell carries.
    monkeypatch.setattr(dashboard, "png_bytes", lambda summaries, **picture: b"\x89PNG")

    def history(rank, steps, last):
        return {
            "seq": last,
            "step": last + 1,
            "cell_first_step": 30,
            "metrics": [{"step": s, "loss": 5.0 - s / 100} for s in steps],
            "overlap": [],
            "steps": [{"step": s, "duration_s": 0.1} for s in steps],
            "memory_history": [{"step": s, "rss_bytes": 1} for s in steps],
            "last_step": {"step": last},
        }

    board = dashboard.Dashboard(redraw_s=0.0, since_cell=True)
    board.update({0: history(0, range(0, 30), 29), 1: history(1, range(0, 31), 30)})
    assert board.summaries[0]["metrics"] == [] and board.summaries[0]["last_step"] is None
    assert [m["step"] for m in board.summaries[1]["metrics"]] == [30]
    board.update({0: history(0, range(10, 34), 33)})
    assert [m["step"] for m in board.summaries[0]["steps"]] == [30, 31, 32, 33]
    board.wait_drawn(30)
    whole = dashboard.Dashboard(redraw_s=0.0)  # `%nbtrain dashboard`: everything kept
    whole.update({0: history(0, range(0, 30), 29)})
    assert len(whole.summaries[0]["metrics"]) == 30
    whole.wait_drawn(30)


def test_no_picture_is_drawn_before_the_first_step(monkeypatch):
    # A picture of empty panels cost a whole draw (seconds on a loaded machine) before
    # the first one with data could start.
    drawn = []
    monkeypatch.setattr(dashboard, "png_bytes", lambda s, **picture: drawn.append(s) or b"P")
    board = dashboard.Dashboard(redraw_s=0.0)
    empty = {**summary(1, 4.0), "metrics": []}
    board.update({0: empty})
    board.wait_drawn(30)  # (the warm-up only)
    assert drawn == [] and board.redraws == 0 and "<td>0</td>" in board.header.value
    board.update({0: summary(2, 3.0)})
    board.wait_drawn(30)
    assert len(drawn) == 1 and board.image.value == b"P"
