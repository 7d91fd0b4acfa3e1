"""The same model code as a plain script under torchrun (init from its variables)."""

import json
import os
import time

import pytest
from support import cases, script_env, torchrun

STEPS = 3


def test_torchrun_script_matches_plain_pytorch():
    script = os.path.join(os.path.dirname(__file__), "torchrun_train.py")
    env = script_env()  # the script imports support.cases
    proc = torchrun(script, STEPS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOSSES"))
    result = json.loads(line.split(" ", 1)[1])
    assert result["world"] == 2 and result["backend"] == "gloo"
    ref_losses, _, _ = cases.train_plain(2, STEPS)
    assert result["losses"] == pytest.approx(ref_losses, abs=1e-5)


def test_a_pipeline_stage_raising_fails_the_script_naming_the_stage():
    script = os.path.join(os.path.dirname(__file__), "pipeline_fail_script.py")
    start = time.monotonic()
    proc = torchrun(script)
    assert proc.returncode != 0 and "NOT REACHED" not in proc.stdout
    assert time.monotonic() - start < 60  # stage 0 is not left waiting on its receive
    assert "ValueError: bad micro-batch on stage 1" in proc.stderr, proc.stderr[-3000:]
    assert "raised on stage 1 of 2 (rank 1), in the forward of micro-batch 2" in proc.stderr
