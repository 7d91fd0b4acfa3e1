"""The dashboard's live curves (nbtrain.notebook.live_panels): each update moves the
existing bqplot lines to the new data (the same Lines objects, longer), one line per
rank or min / median / max above 8 ranks, the loss's smoothed mean beside the ranks'
raw lines, titles with the current numbers, the first step left out of the y range
when it dwarfs the rest; without bqplot the picture holds every panel. The browser's
side (drawn, current, fast) is tests/telemetry/test_dashboard_lab.py's."""

import sys

import pytest
import synthetic

pytest.importorskip("bqplot")


BOARDS = []


@pytest.fixture(autouse=True)
def _pictures_drawn():
    """Each board's picture is drawn in a thread: done before the next test."""
    yield
    while BOARDS:
        BOARDS.pop().wait_drawn(120)


def _board():
    from nbtrain.notebook.dashboard import Dashboard

    # No picture: these tests look at the curves. (redraw_s=3600 drew one per board,
    # 0.3-1 s of a drawing thread's CPU, but only on a machine up for over an hour: the
    # first redraw is due 3600 s after monotonic time 0.) A cell's last picture is still
    # drawn (final=True); the picture beside the curves is drawn in the dashboard
    # notebook's training cell (test_dashboard_kernel.py, test_dashboard_lab.py).
    board = Dashboard(redraw_s=float("inf"))
    board.live_every_s = 0.0  # every update moves them
    BOARDS.append(board)
    return board


def _feed(board, summaries, seq):
    for s in summaries.values():
        s["seq"] = seq
        s["step"] = max(m["step"] for m in s["metrics"])
    board.update(summaries)


def _lines(board, title_start):
    (fig,) = [f for f in board.live.figures if f.title.startswith(title_start)]
    return {m.labels[0]: m for m in fig.marks}


def test_new_points_go_to_the_existing_lines():
    board = _board()
    _feed(board, synthetic.summaries(2, 10), 1)
    first = _lines(board, "loss")
    assert set(first) == {"rank 0", "rank 1", "mean, smoothed"}, first
    assert [len(m.x) for m in first.values()] == [10, 10, 10]
    _feed(board, synthetic.summaries(2, 25), 2)
    later = _lines(board, "loss")
    assert all(later[k] is first[k] for k in first)  # moved, not made again
    assert [len(m.x) for m in later.values()] == [25, 25, 25]
    assert list(later["rank 0"].x[-3:]) == [22, 23, 24]
    assert "nbtrain-live-step-24" in board.live.widget._dom_classes
    for name in ("step time", "tokens/s", "gradient norm", "learning rate", "memory", "comm"):
        assert _lines(board, name), name  # every panel filled by the synthetic run


def test_titles_carry_the_current_numbers_and_the_mean_is_smoothed():
    board = _board()
    summaries = synthetic.summaries(2, 12)
    _feed(board, summaries, 1)
    titles = [f.title for f in board.live.figures]
    assert any(t.startswith("tokens/s (all ranks: ") for t in titles), titles
    assert any(t.startswith("learning rate (0.001") for t in titles), titles
    loss = _lines(board, "loss")
    raw = [(loss["rank 0"].y[i] + loss["rank 1"].y[i]) / 2 for i in range(12)]
    smooth = list(loss["mean, smoothed"].y)
    assert smooth[0] == pytest.approx(raw[0])  # bias-corrected: not pulled toward 0
    assert max(abs(a - b) for a, b in zip(smooth[1:], raw[1:])) > 0  # and smoothed


def test_many_ranks_are_three_lines():
    board = _board()
    _feed(board, synthetic.summaries(12, 6), 1)
    lines = _lines(board, "step time")
    assert set(lines) == {"min of the ranks", "median of the ranks", "max"}, lines


def test_a_slow_first_step_is_left_out_of_the_range():
    board = _board()
    summaries = synthetic.summaries(2, 12)
    for s in summaries.values():
        first = min(row["step"] for row in s["steps"])
        for row in s["steps"] + s["metrics"]:  # step_time_s, where recorded, wins
            if row["step"] == first:
                for key in ("duration_s", "step_time_s"):
                    if key in row:
                        row[key] *= 50
    _feed(board, summaries, 1)
    (fig,) = [f for f in board.live.figures if f.title.startswith("step time")]
    lines = {m.labels[0]: m for m in fig.marks}
    y_scale = fig.axes[1].scale
    assert y_scale.max is not None and y_scale.max < max(lines["rank 0"].y) / 10
    assert y_scale.min >= 0 and not y_scale.allow_padding  # the range set is the range shown
    (hidden,) = [f for f in board.live.figures if f.title.startswith("comm hidden")]
    assert (hidden.axes[1].scale.min, hidden.axes[1].scale.max) == (0.0, 100.0)
    assert fig.axes[1].tick_format == ",.4~r"  # 10,780 and 0.003: no exponent, no offset


def test_a_constant_learning_rate_is_a_line_above_the_floor():
    """A flat rate in a range of zero height drew two "0.003" ticks over each other at
    the bottom; the range runs from 0, the line at its height."""
    board = _board()
    summaries = synthetic.summaries(2, 12)
    for s in summaries.values():
        for m in s["metrics"]:
            m["lr"] = 3e-3
    _feed(board, summaries, 1)
    (fig,) = [f for f in board.live.figures if f.title.startswith("learning rate")]
    scale = fig.axes[1].scale
    assert (scale.min, scale.max) == (0.0, pytest.approx(3.3e-3))


def test_without_bqplot_the_picture_holds_every_panel(monkeypatch):
    from nbtrain.notebook import dashboard

    monkeypatch.setitem(sys.modules, "bqplot", None)  # import bqplot raises ImportError
    board = dashboard.Dashboard()
    assert board.live is None and len(board.widget.children) == 2


def test_after_a_cell_the_picture_holds_every_panel_and_the_button_brings_the_curves():
    board = _board()
    summaries = synthetic.summaries(2, 8)
    _feed(board, summaries, 1)
    board.wait_drawn(120)
    assert board.live.widget.layout.display is None and board.toggle.layout.display == "none"
    board.update({r: dict(s, seq=2) for r, s in summaries.items()}, final=True)
    board.wait_drawn(120)  # the cell's last picture: every panel, the curves hidden
    assert board.live.widget.layout.display == "none" and board.toggle.layout.display is None
    board.toggle.value = True
    assert board.live.widget.layout.display is None and board.image.layout.display == "none"
    board.toggle.value = False
    assert board.live.widget.layout.display == "none" and board.image.layout.display is None
    _feed(board, synthetic.summaries(2, 12), 3)  # the next cell: the curves again
    assert board.live.widget.layout.display is None and board.image.layout.display is None
    assert board.toggle.layout.display == "none"


def test_a_newer_dashboard_retires_the_old_one_to_its_numbers_and_picture():
    """Each `--dashboard` cell shows a new dashboard; the one it replaces keeps its table
    and last picture and lets go of its ranks' histories and its curves' widgets (every
    old one kept its 96 widgets and its histories for the session)."""
    import ipywidgets.widgets.widget as widget

    start = set(widget._instances)
    old = _board()
    old.show()
    summaries = synthetic.summaries(2, 8)
    _feed(old, summaries, 1)
    old.update({r: dict(s, seq=2) for r, s in summaries.items()}, final=True)
    old.wait_drawn(120)
    picture, table = old.image.value, old.header.value
    assert picture and "<table" in table
    olds = set(widget._instances) - start
    new = _board()
    new.show()
    assert old.live is not None  # kept while the new board's cell runs
    _feed(new, synthetic.summaries(2, 4), 1)
    assert old.live is not None
    new.update({}, final=True)  # the new board's cell ended
    assert old.summaries == {} and old.live is None
    assert old.widget.children == (old.header, old.image)
    assert old.image.value == picture and old.header.value == table
    assert old.image.layout.display is None  # the picture, not the hidden curves
    # What is left of it: its box, table and picture, their layouts, the table's style.
    kept = {widget._instances[k] for k in olds & set(widget._instances)}
    parts = (old.widget, old.header, old.image)
    want = {*parts, *(w.layout for w in parts), old.header.style}
    assert {id(w) for w in kept} == {id(w) for w in want}, (len(olds), kept)


def test_the_table_names_each_ranks_host_once_they_span_hosts():
    board = _board()
    summaries = synthetic.summaries(4, steps=3)
    _feed(board, summaries, seq=1)
    assert "<th>host</th>" not in board.header.value  # one host: no column
    for rank, s in summaries.items():
        s["host"] = "node1" if rank < 2 else "node2"
    _feed(board, summaries, seq=2)
    assert "<th>host</th>" in board.header.value
    for rank in range(4):
        assert f"<tr><td>{rank}</td><td>node{1 + rank // 2}</td>" in board.header.value
