"""The dashboard in a real kernel (nbclient): its widgets change while the cell runs."""

import re

import pytest

# The notebook packages ([notebook]/[test] extras) may be absent, e.g. on a bare GPU machine
# running only `pytest -m gpu`: skip this module there rather than fail collection.
for _needed in ("nbformat", "nbclient", "ipywidgets"):
    pytest.importorskip(_needed)

import dashboard_notebook


@pytest.fixture(scope="module")
def executed(dashboard_run):
    return dashboard_run


def _header_steps(updates):
    """Step numbers shown in the dashboard's table, in the order they were sent."""
    steps = []
    for _, _, data in updates:
        value = data.get("state", {}).get("value")
        if isinstance(value, str) and "<th>hidden comm</th>" in value:
            steps.append(max(int(s) for s in re.findall(r"<tr><td>\d+</td><td>(\d+)</td>", value)))
    return steps


def test_dashboard_updates_while_the_cell_runs(executed):
    path, client = executed
    cell = dashboard_notebook.TRAIN_CELL
    during = [u for u in client.updates if u[1] == cell]
    steps = _header_steps(during)
    # Several distinct, growing step counts arrived before the cell finished.
    assert len(set(steps)) >= 4, steps
    assert steps == sorted(steps) and steps[-1] == dashboard_notebook.STEPS
    early = [t for t, _, data in during if "value" in data.get("state", {})]
    assert min(early) < client.cell_done[cell] - 1.0  # not all at the end
    header = [
        d["state"]["value"]
        for _, _, d in during
        if "<th>step time</th>" in str(d.get("state", {}).get("value"))
    ]
    assert header and " ms</td>" in header[-1]


def test_widget_state_is_stored_with_the_figure(executed):
    import nbformat

    nb = nbformat.read(str(executed[0]), as_version=4)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = {m["model_name"] for m in state.values()}
    assert {"ImageModel", "HTMLModel", "VBoxModel"} <= models
    images = [m for m in state.values() if m["model_name"] == "ImageModel"]
    # One from `%%distributed --dashboard`, one from `%nbtrain dashboard` afterwards.
    assert len(images) == 2 and all(m["buffers"] for m in images), "a figure was not stored"
    # Each dashboard is its table, the curves' button and grid and its figure: progress
    # is rank 0's bar in the cell's output only (a progress widget in the dashboard
    # showed it a second time). After its cell the figure holds every panel and is
    # shown, the curves hidden: what a saved or exported notebook shows. The first,
    # retired by the second, is its table and figure alone (its curves closed).
    boards = [m["state"] for m in state.values() if m["model_name"] == "VBoxModel"]
    boards.sort(key=lambda b: len(b["children"]))  # the retired one first
    kinds = [
        [state[c.removeprefix("IPY_MODEL_")]["model_name"] for c in b["children"]] for b in boards
    ]
    assert kinds == [
        ["HTMLModel", "ImageModel"],
        ["HTMLModel", "ToggleButtonModel", "BoxModel", "ImageModel"],
    ], kinds

    def display(child):
        layout = state[child.removeprefix("IPY_MODEL_")]["state"]["layout"]
        return state[layout.removeprefix("IPY_MODEL_")]["state"].get("display")

    _, image = boards[0]["children"]
    assert display(image) is None  # the retired board shows its figure
    _, button, grid, image = boards[1]["children"]
    assert (display(button), display(grid), display(image)) == (None, "none", None)
    later = nb.cells[dashboard_notebook.DASHBOARD_CELL].outputs
    assert [o["output_type"] for o in later] == ["display_data"]
    assert "application/vnd.jupyter.widget-view+json" in later[0]["data"]
    # Progress: one tqdm widget in the cell's output, moved by rank 0's loop (the test
    # below), which at the last step became its last line of text with the loss, its
    # widgets closed (11 a cell stayed in the kernel); no text lines of a bar from a rank.
    outputs = nb.cells[dashboard_notebook.TRAIN_CELL].outputs
    text = "".join(o.get("text", "") for o in outputs)
    assert "train:" not in text and "[rank 1]" not in text, text
    # (nbclient keeps a closed widget's last state in the file; the kernel's registry
    # is counted per cell by tests/notebook/test_engine_memory.py.)
    steps = dashboard_notebook.STEPS
    shown = [o["data"]["text/plain"] for o in outputs if "text/plain" in o.get("data", {})]
    finals = [t for t in shown if "train:" in t]
    assert len(finals) == 1 and f"{steps}/{steps}" in finals[0] and "loss=" in finals[0], shown


def test_the_progress_bar_moves_while_the_cell_runs(executed):
    _, client = executed
    cell = dashboard_notebook.TRAIN_CELL
    counts = [
        (t, data["state"]["value"])
        for t, c, data in client.updates
        if c == cell and isinstance(data.get("state", {}).get("value"), float)
    ]
    values = [v for _, v in counts]
    assert values == sorted(values) and values[-1] == dashboard_notebook.STEPS, values
    early = [v for t, v in counts if t < client.cell_done[cell] - 1.0]
    assert len(set(early)) >= 3, counts  # it moved step by step, not only at the end
