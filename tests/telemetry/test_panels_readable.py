"""What makes the panels readable at a glance: the warm-up step does not set the scale,
no offset notation, rates that add up, tokens counted without the user's help, no
column for a collective that moved nothing, and a label on one that moved a few bytes."""

import copy

import pytest
import synthetic

from nbtrain.telemetry import panels

STEPS = 12


def _axes(summaries):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = panels.figure(summaries)
    FigureCanvasAgg(fig).draw()
    return {ax.get_title().split(" (")[0]: ax for ax in fig.axes if ax.get_title()}


def _metric_rows(summaries):
    for s in summaries.values():
        for m in s["metrics"]:
            yield m


@pytest.fixture
def run_of_two():
    return copy.deepcopy(synthetic.summaries(2, STEPS))


def test_a_slow_first_step_does_not_flatten_the_step_time_panel(run_of_two):
    for m in _metric_rows(run_of_two):
        if m["step"] == 0 and "step_time_s" in m:
            m["step_time_s"] = 0.6  # compilation, the first gathers: 20x the others
    ax = _axes(run_of_two)["step time per rank"]
    rest = max(y for line in ax.lines[:2] for y in line.get_ydata()[1:])
    low, high = ax.get_ylim()
    assert high < 1.3 * rest < 600, (low, high, rest)  # the scale is the other steps'
    assert ax.lines[0].get_ydata()[0] == pytest.approx(600)  # still drawn, off the top


def test_memory_ticks_are_plain_numbers(run_of_two):
    for s in run_of_two.values():
        for i, row in enumerate(s["memory_history"]):
            row["rss_bytes"] = int((370.1 + 0.001 * i) * 2**20)  # a flat 370 MiB
    ax = _axes(run_of_two)["memory per rank"]
    assert ax.yaxis.get_offset_text().get_text() == ""
    assert all("e" not in t.get_text() for t in ax.get_yticklabels())


def test_tokens_per_second_add_up_over_ranks_and_steps_per_second_average(run_of_two):
    title = _axes(run_of_two)["tokens/s per rank"].get_title()
    rates = []
    for s in run_of_two.values():  # 512 tokens a step, over the last 10 steps' time
        times = panels.step_times(s)
        last = sorted(times)[-10:]
        rates.append(512 * len(last) / sum(times[x] for x in last))
    assert f"all ranks: {sum(rates):,.0f} tokens/s" in title, title
    for m in _metric_rows(run_of_two):
        m.pop("tokens", None)
    full = _axes(run_of_two)["steps/s per rank"].get_title()
    mean = sum(r / 512 for r in rates) / 2
    assert f"mean of ranks: {mean:,.1f} steps/s" in full, full


def test_the_wrapped_models_token_count_gives_tokens_per_second(run_of_two):
    for m in _metric_rows(run_of_two):
        if "tokens" in m:
            m["batch_tokens"] = m.pop("tokens")  # what nbt.wrap's counter records
    ax = _axes(run_of_two)
    assert "tokens/s per rank" in ax
    assert "batch_tokens" not in str([a.get_legend_handles_labels()[1] for a in ax.values()])


def test_a_collective_kind_that_moved_nothing_has_no_column(run_of_two):
    for s in run_of_two.values():
        for row in s["steps"]:
            row.setdefault("comm", {})["all_reduce"] = [0, 0.001]  # e.g. a 0-byte barrier
    comm = _axes(run_of_two)["communication by kind"]
    assert [t.get_text() for t in comm.get_xticklabels()] == ["all\ngather", "reduce\nscatter"]


def test_a_kind_that_moves_a_few_bytes_is_labelled_and_no_legend_covers_a_bar(run_of_two):
    """An overflow flag's 16 bytes beside 300 KiB of gathers is a bar too low to see:
    its column says how much, and the legends sit in the head room above the bars."""
    for s in run_of_two.values():
        for row in s["steps"]:
            row.setdefault("comm", {})["all_reduce"] = [16, 0.001]
    comm = _axes(run_of_two)["communication by kind"]
    labels = [t.get_text() for t in comm.texts]
    assert "16 B" in labels, labels
    tallest = max(b.get_height() + 0.0 for b in comm.patches)
    assert comm.get_ylim()[1] >= 1.3 * tallest


def test_the_next_picture_of_the_same_panels_reuses_their_layout():
    # Constrained layout was half of each dashboard picture's cost.
    panels._LAYOUTS.clear()
    panels.png_bytes(synthetic.summaries(2, 12), dpi=40)
    ((positions, uses),) = panels._LAYOUTS.values()
    assert uses == 0 and len(positions) >= 10
    panels.png_bytes(synthetic.summaries(2, 20), dpi=40)  # more steps, other titles
    assert [u for _, u in panels._LAYOUTS.values()] == [1]
    fewer = synthetic.summaries(2, 12)
    for m in _metric_rows(fewer):
        m.pop("accuracy", None)  # no accuracy axis beside the loss: other axes
    panels.png_bytes(fewer, dpi=40)
    assert sorted(u for _, u in panels._LAYOUTS.values()) == [0, 1]
