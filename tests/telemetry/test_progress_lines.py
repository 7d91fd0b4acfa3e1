"""The cell's progress bar in the notebook (CellProgress) from what a rank publishes,
and `nbtrain.progress` outside an engine (a script's own tqdm bar)."""

import io

import pytest
from tqdm import tqdm

import nbtrain
from nbtrain import telemetry
from nbtrain.notebook import progress_bar


@pytest.fixture
def text_bars(monkeypatch):
    """tqdm's text bar into a buffer in place of tqdm.auto's choice."""
    out = io.StringIO()
    bars = []

    def new_bar(published):
        bar = tqdm(total=published["total"], desc=published["desc"], file=out, mininterval=0)
        bars.append(bar)
        return bar

    monkeypatch.setattr(progress_bar, "_new_bar", new_bar)
    return out, bars


def _rank_metadata(progress):
    return {"data": {"nbtrain": {"progress": progress}}}


def test_the_bar_follows_the_published_count_and_a_new_loop_opens_a_new_bar(text_bars):
    out, bars = text_bars
    metadata = [{}, {}]  # rank 0 has published nothing yet
    view = progress_bar.CellProgress(metadata)
    view.update()
    assert bars == []
    for n in (0, 3, 7):
        metadata[0] = _rank_metadata({"id": "a", "total": 10, "desc": "train", "n": n, "loss": 2.5})
        view.update()
    assert bars[0].n == 7 and "loss=2.5000" in out.getvalue()
    metadata[0] = _rank_metadata({"id": "a", "total": 10, "desc": "train", "n": 10, "done": True})
    view.update()
    assert view.bar is None and "10/10" in out.getvalue()
    view.update()  # the same finished loop: no second bar
    assert len(bars) == 1
    metadata[0] = _rank_metadata({"id": "b", "total": 4, "desc": "eval", "n": 2})
    view.update(final=True)  # the cell ended: the bar shows the last count and closes
    assert len(bars) == 2 and bars[1].n == 2 and view.bar is None
    assert "eval:  50%" in out.getvalue()


def test_progress_outside_an_engine_is_a_tqdm_bar_and_publishes_its_count(capsys):
    seen = []
    for _ in nbtrain.progress(range(4), desc="script", mininterval=0):
        telemetry.next_step()
        seen.append(dict(telemetry.RECORDER.progress))
    assert [p["n"] for p in seen] == [0, 1, 2, 3]  # published before each body
    final = telemetry.RECORDER.progress
    assert final["n"] == 4 and final["done"] and final["total"] == 4
    assert "script: 100%" in capsys.readouterr().err
