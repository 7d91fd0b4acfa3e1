"""The README's 60-second tour, cell by cell, in a real IPython shell on 2 real gloo
ranks: every cell it shows runs as shown, the model cell shards the GPT over both ranks
and the training cell lowers the loss."""

import math
import re
from pathlib import Path

import pytest

for _needed in ("IPython", "ipyparallel", "ipywidgets"):
    pytest.importorskip(_needed)
from IPython.utils.capture import capture_output

from nbtrain.notebook import magics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def tour_cells() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## A 60-second tour\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert section, "README has no '## A 60-second tour' section"
    return re.findall(r"^```python\n(.*?)^```", section.group(1), re.MULTILINE | re.DOTALL)


def test_the_tour_shows_a_start_a_model_a_training_cell_and_a_stop():
    cells = tour_cells()
    assert cells[0].startswith("%load_ext nbtrain") and "%nbtrain start" in cells[0]
    assert any("model.loss" in c and "optim.step()" in c for c in cells), cells
    assert cells[-1].strip() == "%nbtrain stop"


def test_every_tour_cell_runs_as_shown(ipython):
    outputs = []
    try:
        for cell in tour_cells():
            with capture_output() as cap:
                result = ipython.run_cell(cell)
            outputs.append(cap.stdout)
            assert result.success, (cell, cap.stdout, cap.stderr, result.error_in_exec)
    finally:
        if magics.current_cluster() is not None:
            ipython.run_line_magic("nbtrain", "stop")
    _, build, train, _ = outputs
    shards = [int(n) for n in re.findall(r"\[rank \d\] \d (\d+) elements on this rank", build)]
    assert len(shards) == 2 and shards[0] > 0, build
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+) after 30 steps", train)]
    # Bytes: a model that learned nothing scores ln(256) = 5.55.
    assert len(losses) == 1 and losses[0] < math.log(256) - 0.5, train
    assert magics.current_cluster() is None
