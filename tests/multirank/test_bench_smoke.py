"""`nbtrain bench --quick` runs end to end and the four engines' losses agree.

Timings are not asserted: this machine is shared and they are noise here. The
benchmark's speed and memory claims are numbers it prints, not test outcomes.
"""
import json
import os
import subprocess
import sys

ENGINES = {"zero3", "zero2", "fsdp2", "ddp"}


def test_quick_bench_runs_and_losses_agree(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nbtrain.cli", "bench", "--quick",
                           "--ranks", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert set(result["runs"]) == ENGINES
    for name, run in result["runs"].items():
        assert run["parity"], (name, run["loss_max_abs_diff_vs_ddp"])
        assert len(run["losses"]) == result["settings"]["warmup"] + result["settings"]["steps"]
        assert run["step_time_s"] > 0 and run["state_bytes"] > 0, name
        assert run["wire_bytes_per_step"] > 0, name
    # Parity must compare real training, not four copies of one number.
    losses = result["runs"]["ddp"]["losses"]
    assert len(set(round(x, 6) for x in losses)) > 1
    assert set(result["ratios"]) == {"zero3_step_vs_fsdp2", "zero3_step_vs_ddp",
                                     "zero3_state_mem_vs_theory", "zero3_bytes_vs_theory"}
    assert "zero3" in proc.stdout and "hidden %" in proc.stdout
