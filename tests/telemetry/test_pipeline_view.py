"""The pipeline's timeline and bubble: from made-up spans of a perfect schedule (the
bubble is the theory's), and from a real torchrun pipeline through `nbtrain report`."""

import os
import re
import subprocess
import sys

import pytest
from support.cli import run_cli

from nbtrain.telemetry import panels, pipeline_view
from nbtrain.telemetry.steplog import StepLog

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def perfect_1f1b(stages: int, micro: int, fwd: float = 1.0, bwd: float = 2.0) -> dict:
    """{rank: summary} of one 1F1B step with equal stages and free transfers, timed by
    simulation: a forward needs the previous stage's forward, a backward the next
    stage's backward of the same micro-batch."""
    from nbtrain.pipeline.schedule import _order

    done, clock = {}, [0.0] * stages
    orders = [list(_order("1f1b", stages, s, micro)) for s in range(stages)]
    while any(orders):
        for s in range(stages):
            while orders[s]:
                kind, i = orders[s][0]
                need = (s - 1, "f", i) if kind == "f" else (s + 1, "b", i)
                if kind == "f" and s == 0 or kind == "b" and s == stages - 1:
                    ready = done.get((s, "f", i), 0.0) if kind == "b" else 0.0
                elif need in done:
                    ready = done[need]
                else:
                    break
                start = max(clock[s], ready)
                clock[s] = done[(s, kind, i)] = start + (fwd if kind == "f" else bwd)
                orders[s].pop(0)
    summaries = {}
    for s in range(stages):
        log = StepLog()
        for (stage, kind, i), end in sorted(done.items(), key=lambda kv: kv[1]):
            if stage == s:
                length = fwd if kind == "f" else bwd
                log.feed(
                    {
                        "type": "compute",
                        "label": f"stage{s}.mb{i}",
                        "start": end - length,
                        "end": end,
                        "phase": "forward" if kind == "f" else "backward",
                        "step": 0,
                    }
                )
        log.feed({"type": "step_end", "t": max(clock), "step": 0})
        summaries[s] = log.summary()
    return summaries


@pytest.mark.parametrize("stages,micro", [(2, 4), (3, 6), (4, 4)])
def test_a_perfect_schedule_has_the_theorys_bubble(stages, micro):
    info = pipeline_view.analyse(perfect_1f1b(stages, micro))
    assert (info["stages"], info["micro"], info["virtual"]) == (stages, micro, 1)
    assert info["theory"] == pytest.approx((stages - 1) / (micro + stages - 1))
    assert info["bubble"] == pytest.approx(info["theory"])
    for rank in info["ranks"].values():  # every stage idles the same share
        assert rank["bubble"] == pytest.approx(info["theory"])


def test_a_run_without_a_pipeline_keeps_the_compute_and_comm_timeline():
    from synthetic import summaries

    runs = summaries(2, 3)
    assert pipeline_view.analyse(runs) is None
    titles = [a.get_title() for a in panels.figure(runs).axes]
    assert "last step: communication vs compute" in titles


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("pp") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(HERE, "pipeline_script.py"),
            str(run),
            "3",
            "1f1b",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def test_report_draws_the_stages_and_prints_the_bubble_beside_the_theory(pipeline_run, tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from nbtrain.telemetry.report import load_run

    out = tmp_path / "report.png"
    # `nbtrain report` in this process (support.cli.run_cli): a `python -m nbtrain.cli`
    # subprocess imported torch and matplotlib again for a second of drawing. The real
    # command line is test_report.py::test_report_renders_png_and_html's.
    proc = run_cli("report", pipeline_run, "-o", out)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("pipeline:"))
    assert line.startswith("pipeline: 2 stages, 4 micro-batches; bubble ")
    assert "20.0% in theory (P-1)/(M+P-1)" in line
    measured = float(re.search(r"bubble ([\d.]+)% measured", line).group(1))
    assert 0 < measured < 100
    assert out.stat().st_size > 10_000

    summaries = load_run(str(pipeline_run))
    info = pipeline_view.analyse(summaries)
    assert {r["stage"] for r in info["ranks"].values()} == {0, 1}
    # Each stage ran every micro-batch forward and backward in the last step.
    for rank in info["ranks"].values():
        assert sorted((mb, phase) for _, _, mb, _, phase in rank["spans"]) == sorted(
            (mb, phase) for mb in range(4) for phase in ("backward", "forward")
        )
        assert rank["p2p"], "the transfers between the stages are drawn too"
    fig = panels.figure(summaries)
    FigureCanvasAgg(fig).draw()
    bottom = next(a for a in fig.axes if a.get_title().startswith("last step: pipeline"))
    assert [t.get_text() for t in bottom.get_yticklabels()] == [
        "rank 0\nstage 0",
        "rank 1\nstage 1",
    ]
    assert "in theory" in bottom.get_xlabel()
