"""The panels, drawn from synthetic StepLog summaries of 2 and 64 ranks: every panel
draws its data (lines, bands, labels), and every step axis has integer ticks."""

import pytest
import synthetic

from nbtrain.telemetry import panels
from nbtrain.telemetry.panels_base import MAX_RANKS_SHOWN

STEPS = 12
TITLES = {
    "step time per rank",
    "tokens/s per rank",
    "loss and metrics",
    "gradient norm",
    "learning rate",
    "communication hidden behind compute",
    "memory per rank",
    "model state per rank",
    "communication by kind",
    "last step: communication vs compute",
}


def _drawn(summaries):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = panels.figure(summaries)
    FigureCanvasAgg(fig).draw()  # lays out the ticks the tests read
    main = {}
    for ax in fig.axes:
        if ax.get_title():
            main[ax.get_title().split(" (")[0]] = ax
    return fig, main


def _twin(fig, ax):
    twins = [o for o in fig.axes if o is not ax and ax.get_shared_x_axes().joined(ax, o)]
    assert len(twins) == 1, f"{ax.get_title()}: {len(twins)} twin axes"
    return twins[0]


def _labels(ax):
    return [line.get_label() for line in ax.lines]


@pytest.fixture(scope="module")
def two():
    return _drawn(synthetic.summaries(2, STEPS))


@pytest.fixture(scope="module")
def many():
    return _drawn(synthetic.summaries(64, STEPS, cuda=True))


def _integer_step_ticks(fig):
    step_axes = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert len(step_axes) >= 8
    for ax in step_axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_two_ranks_every_panel_draws_its_data(two):
    fig, ax = two
    assert set(ax) == TITLES
    _integer_step_ticks(fig)
    for title in (
        "step time per rank",
        "tokens/s per rank",
        "gradient norm",
        "communication hidden behind compute",
        "memory per rank",
    ):
        assert _labels(ax[title]) == ["rank 0", "rank 1"], title
        assert all(len(line.get_xdata()) == STEPS for line in ax[title].lines), title
    # Skew: its own labelled axis, rank 1 slower than rank 0 on every step.
    skew = _twin(fig, ax["step time per rank"])
    assert skew.get_ylabel() == "slowest / fastest rank"
    assert all(r > 1.1 for r in skew.lines[0].get_ydata())
    assert "skew" in ax["step time per rank"].get_title()
    rank0_ms = ax["step time per rank"].lines[0].get_ydata()
    rank0_tps = ax["tokens/s per rank"].lines[0].get_ydata()
    assert [pytest.approx(512 / (ms / 1e3)) for ms in rank0_ms] == list(rank0_tps)
    # Loss with the user metrics: val_loss on the loss axis, accuracy on its own.
    loss = ax["loss and metrics"]
    assert _labels(loss) == ["rank 0", "rank 1", "mean, smoothed", "val_loss"]
    assert list(loss.lines[3].get_xdata()) == [3, 7, 11]
    # Beside the raw lines, the ranks' mean smoothed (bias-corrected: it starts there).
    raw = [loss.lines[r].get_ydata() for r in (0, 1)]
    mean = [(a + b) / 2 for a, b in zip(*raw)]
    smooth = loss.lines[2].get_ydata()
    assert smooth[0] == pytest.approx(mean[0])
    assert min(mean) <= smooth[-1] <= max(mean) and list(smooth) != mean
    assert _twin(fig, loss).get_ylabel() == "accuracy"
    # lr alone on a labelled linear axis (a loss scale of 1 draws nothing).
    lr = ax["learning rate"]
    assert lr.get_ylabel() == "learning rate" and lr.get_yscale() == "linear"
    assert max(lr.lines[0].get_ydata()) == pytest.approx(1e-3)
    assert ax["memory per rank"].get_ylabel() == "MiB (process RSS)"
    assert ax["communication hidden behind compute"].get_ylim() == (0, 100)


def test_two_ranks_memory_split_and_comm_by_kind(two):
    fig, ax = two
    state = ax["model state per rank"]
    assert [c.get_label() for c in state.collections] == [
        "rank 0: parameters",
        "rank 0: gradients",
        "rank 0: optimizer state",
    ]
    assert _labels(state) == ["rank 1 total", "whole model's parameters"]
    assert max(state.lines[0].get_ydata()) == pytest.approx(12.0)  # MiB: 3 + 3 + 6
    assert list(state.lines[1].get_ydata()) == [6.0, 6.0]  # two shards of 3 MiB
    comm = ax["communication by kind"]
    assert [t.get_text() for t in comm.get_xticklabels()] == ["all\ngather", "reduce\nscatter"]
    # 3 gathers of 4 MiB and one 8 MiB reduce-scatter a step.
    assert [round(p.get_height(), 6) for p in comm.patches] == [12.0, 8.0]
    assert comm.get_ylabel() == "MiB per step (per rank)"
    bandwidth = _twin(fig, comm)
    assert bandwidth.get_ylabel().endswith("/s achieved") and len(bandwidth.patches) == 2
    timeline = ax["last step: communication vs compute"]
    assert [t.get_text().split("\n")[0] for t in timeline.get_yticklabels()] == ["rank 0", "rank 1"]


def test_64_ranks_draw_bands_not_64_lines(many):
    fig, ax = many
    assert set(ax) == TITLES
    _integer_step_ticks(fig)
    for a in fig.axes:
        assert len(a.lines) <= MAX_RANKS_SHOWN, (a.get_title(), len(a.lines))
    for title in (
        "step time per rank",
        "tokens/s per rank",
        "loss and metrics",
        "gradient norm",
        "communication hidden behind compute",
    ):
        bands = [c.get_label() for c in ax[title].collections]
        assert "min-max of 64 ranks" in bands, title
        assert "median of the ranks" in _labels(ax[title]), title
    memory = ax["memory per rank"]
    assert {"allocated: median of the ranks", "reserved: median of the ranks"} <= set(
        _labels(memory)
    )
    assert "CUDA allocated" in memory.get_ylabel()
    state = ax["model state per rank"]
    assert state.collections[0].get_label() == "rank 31: parameters"  # the median rank
    timeline = ax["last step: communication vs compute"]
    assert [t.get_text().split(" ")[0] for t in timeline.get_yticklabels()] == [
        "min",
        "median",
        "max",
    ]
    skew = _twin(fig, ax["step time per rank"]).lines[0].get_ydata()
    assert all(1.5 < r < 2.0 for r in skew)  # rank 63 takes nearly twice rank 0's time


def test_empty_summaries_say_what_is_missing():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = panels.figure({0: {"metrics": [], "overlap": [], "steps": [], "memory_history": []}})
    FigureCanvasAgg(fig).draw()
    texts = [t.get_text() for a in fig.axes for t in a.texts]
    assert "no finished step yet" in texts and any("telemetry.watch" in t for t in texts)


def test_dashboard_at_64_ranks_aggregates_its_table():
    pytest.importorskip("ipywidgets")
    from nbtrain.notebook.dashboard import Dashboard

    board = Dashboard(redraw_s=0.0)
    summaries = synthetic.summaries(64, 6)
    for s in summaries.values():
        s.update(seq=1, step=6)
    board.update(summaries, final=True)
    board.wait_drawn(60)  # the picture is drawn in a thread
    rows = board.header.value.split("<tr>")[2:]
    assert [r.split("</td>")[0] for r in rows] == ["<td>min", "<td>median", "<td>max"]
    assert "<th>step time</th>" in board.header.value
    assert board.image.value[:4] == b"\x89PNG" and board.redraws == 1


def test_dashboard_merges_tail_publications_into_full_history():
    pytest.importorskip("ipywidgets")
    from nbtrain.notebook.dashboard import Dashboard
    from nbtrain.telemetry.sinks import PUBLISH_TAIL_POINTS
    from nbtrain.telemetry.steplog import StepLog

    board = Dashboard(redraw_s=float("inf"))
    log, seq = StepLog(), 0
    for event in synthetic.rank_events(0, 1, 40):
        log.feed(event)
        if event["type"] == "step_end":  # engines publish the newest steps only
            seq += 1
            board.update({0: {**log.summary(PUBLISH_TAIL_POINTS if seq > 1 else 300), "seq": seq}})
    merged = board.summaries[0]
    for key in ("metrics", "overlap", "steps", "memory_history"):
        assert [m["step"] if isinstance(m, dict) else m[0] for m in merged[key]] == list(
            range(40)
        ), key


def test_one_rank_comm_panel_says_nothing_moved():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    summary = synthetic.summaries(1, 4)[0]
    for row in summary["steps"]:  # a world of one: collectives run, ring bytes are 0
        row["comm"] = {kind: [0, busy] for kind, (_, busy) in row["comm"].items()}
    fig = panels.figure({0: summary})
    FigureCanvasAgg(fig).draw()
    comm = next(a for a in fig.axes if a.get_title().startswith("communication by kind"))
    assert "moved no bytes" in comm.texts[0].get_text() and not comm.patches
