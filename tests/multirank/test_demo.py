"""`nbtrain demo`, the main job, end to end on 2 CPU ranks (a shortened run)."""

import json
import os
import subprocess
import sys

from safetensors.torch import load_file
from support.cli import run_cli

from nbtrain.demo import summarise


def test_demo_trains_and_writes_its_outputs(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbtrain.cli",
            "demo",
            "--ranks",
            "2",
            "--steps",
            "80",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "losses.json").read_text())
    assert result["world_size"] == 2 and len(result["losses"]) == 80
    first, last = summarise(result["losses"])
    assert last < first - 0.5, (first, last)  # the loss falls visibly
    for name in (
        "report.png",
        "model.safetensors",
        "checkpoint/meta.json",
        "telemetry/rank0.jsonl",
        "telemetry/rank1.jsonl",
    ):
        assert (out / name).exists(), name
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    weights = load_file(str(out / "model.safetensors"))
    assert "tok.weight" in weights and "layers.1.mlp.2.weight" in weights
    assert str(out / "report.png") in proc.stdout
    # The report's panels have data: every step's model state per rank, and tokens/s.
    from nbtrain.telemetry.report import load_run, rank_table

    summaries = load_run(str(out / "telemetry"))
    for rank, summary in summaries.items():
        counted = [m for m in summary["memory_history"] if m.get("model_state_bytes")]
        assert len(counted) >= 79, (rank, len(counted))  # not just the last sample
        assert all(m.get("full_param_bytes") for m in counted), rank
    rows = rank_table(summaries)
    assert all(row["tokens_per_s_median"] and row["model_state_mib"] > 0 for row in rows), rows


def test_demo_in_bf16_trains_and_writes_a_checkpoint(tmp_path):
    """`nbtrain demo --dtype bf16`: bf16 Blocks reducing in fp32, AdamOptimizer's fp32
    master weights; a few steps, the loss finite and falling, bf16 weights saved."""
    import math

    import torch

    out = tmp_path / "demo"
    # In this process (the first test runs the real command line).
    run = run_cli("demo", "--ranks", "2", "--steps", "30", "--dtype", "bf16", "--out", out)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ZeRO-3, bf16" in run.stdout, run.stdout
    result = json.loads((out / "losses.json").read_text())
    assert result["dtype"] == "bf16" and len(result["losses"]) == 30
    assert all(math.isfinite(x) for x in result["losses"]), result["losses"]
    first, last = summarise(result["losses"])
    assert last < first, (first, last)
    assert (out / "checkpoint/meta.json").exists()
    weights = load_file(str(out / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
