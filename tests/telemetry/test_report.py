"""`nbtrain report` renders a PNG and an HTML page from a real torchrun run."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("torchrun") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(HERE, "train_script.py"),
            str(run),
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def test_each_rank_writes_jsonl(run_dir):
    for rank in (0, 1):
        events = [json.loads(line) for line in open(run_dir / f"rank{rank}.jsonl")]
        assert events[0]["type"] == "meta" and events[0]["rank"] == rank
        kinds = {e["type"] for e in events}
        assert {"compute", "comm", "metric", "memory", "step_end"} <= kinds
        assert [e["step"] for e in events if e["type"] == "step_end"] == [0, 1, 2, 3]
        memory = [e for e in events if e["type"] == "memory"]
        assert len(memory) == 4 and all(
            e["param_bytes"] > 0 and e["optimizer_bytes"] > 0 for e in memory
        )
        metrics = {k for e in events if e["type"] == "metric" for k in e}
        assert {"loss", "lr", "grad_norm", "step_time_s", "tokens", "val_loss"} <= metrics


def test_report_draws_the_dashboard_panels_from_the_run(run_dir):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from nbtrain.telemetry import panels
    from nbtrain.telemetry.report import load_run, rank_table

    summaries = load_run(str(run_dir))
    fig = panels.figure(summaries)
    FigureCanvasAgg(fig).draw()
    ax = {a.get_title().split(" (")[0]: a for a in fig.axes if a.get_title()}
    lines = {t: [line.get_label() for line in a.lines] for t, a in ax.items()}
    assert lines["step time per rank"][:2] == ["rank 0", "rank 1"]
    assert "skew" in ax["step time per rank"].get_title()
    assert lines["tokens/s per rank"] == ["rank 0", "rank 1"]
    assert lines["loss and metrics"] == ["rank 0", "rank 1", "mean, smoothed", "val_loss"]
    assert lines["gradient norm"] == ["rank 0", "rank 1"]
    assert ax["learning rate"].get_ylabel() == "learning rate"
    state = ax["model state per rank"]
    assert len(state.collections) == 3
    # ZeRO-3 over 2 ranks: the rank's parameter shard is about half the whole model.
    shard = state.collections[0].get_paths()[0].vertices[:, 1].max()
    assert lines["model state per rank"][-1] == "whole model's parameters"
    assert 0.45 < shard / state.lines[-1].get_ydata()[0] < 0.6
    kinds = [t.get_text() for t in ax["communication by kind"].get_xticklabels()]
    assert kinds == ["all\ngather", "all\nreduce", "reduce\nscatter"]  # all_reduce: grad norm
    for a in fig.axes:
        if a.get_xlabel() == "step":
            assert all(float(t).is_integer() for t in a.get_xticks()), a.get_title()
    rows = rank_table(summaries)
    assert all(r["step_ms_median"] > 0 and r["tokens_per_s_median"] > 0 for r in rows)


def test_report_renders_png_and_html(run_dir, tmp_path):
    from matplotlib.image import imread

    png = tmp_path / "report.png"
    # The real command line, `python -m nbtrain.cli report`: the telemetry tests' one
    # (test_pipeline_view.py runs the same command in its process, support.cli.run_cli).
    proc = subprocess.run(
        [sys.executable, "-m", "nbtrain.cli", "report", str(run_dir), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr
    assert "hidden comm" in proc.stdout and len(proc.stdout.splitlines()) == 5
    assert "peak: process resident memory (CPU rank)" in proc.stdout  # what "peak MiB" means
    pixels = imread(png)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 800
    # Not a blank canvas: the panels put many distinct colours on it.
    assert len({tuple(p) for p in pixels[::4, ::4, :3].reshape(-1, 3).tolist()}) > 50

    from nbtrain.telemetry.report import main

    html = tmp_path / "report.html"
    assert main([str(run_dir), "-o", str(html)]) == 0
    text = html.read_text()
    assert "data:image/png;base64," in text and "rank  steps" in text
