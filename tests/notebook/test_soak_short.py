"""The soak command, short: a real kernel, 2 ranks, the dashboard shown, 24 training
cells with a rank killed, 2 interrupts and 1 restart at seeded random points. No cell
is lost, every interrupt keeps the ranks' namespaces, no process outlives the session,
the kernel's memory stays within a loose bound, and a cell does not wait for the
dashboard's picture (tests/stress/soak_session.py runs the 500-cell version at 3 ranks).

Two ranks are enough for every figure checked here (the all_reduce and the namespace
marker are checked against the world size, whatever it is), and each kill or restart
starts every engine again: one kill instead of two and 2 ranks instead of 3 took the
test from about 180 s to about 60 s on 2 loaded cores."""

import os
import re
import subprocess
import sys

import pytest

for _needed in ("jupyter_client", "ipykernel", "ipyparallel", "ipywidgets"):
    pytest.importorskip(_needed)

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOAK = os.path.join(REPO, "tests", "stress", "soak_session.py")


def test_cells_with_a_killed_rank_interrupts_and_a_restart():
    proc = subprocess.run(
        [
            sys.executable,
            SOAK,
            "--cells",
            "24",
            "--failures",
            "1",
            "--interrupts",
            "2",
            "--restarts",
            "1",
            "--ranks",
            "2",
            "--seed",
            "1",
            "--every",
            "12",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=560,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert "injected: 1 rank failures, 2 interrupts, 1 restarts" in out, out
    assert re.search(r"^cells lost: 0$", out, re.MULTILINE), out
    assert re.search(r"^namespaces kept: 2 of 2 interrupts$", out, re.MULTILINE), out
    assert re.search(r"^processes left over: 0 of \d+ started$", out, re.MULTILINE), out
    growth = float(re.search(r"^kernel RSS: .*: ([+-][\d.]+) MiB$", out, re.MULTILINE).group(1))
    assert growth < 120, out  # +37 to +45 MiB measured from cell 5 (see tests/stress/README.md)
    recover = float(re.search(r"^longest time to recover: ([\d.]+) s", out, re.MULTILINE).group(1))
    assert recover < 120, out
    # The bug the soak first found: each cell waited for the dashboard's last picture
    # (drawn in the kernel, 1-5 s on 2 loaded cores). A cell that waits takes longer
    # than a picture; a cell that does not, a fraction of one (0.19 s against 0.84 s
    # measured; 0.78 s against 0.74 s with the wait put back by hand).
    cell = float(re.search(r"^training cell time: median ([\d.]+) s", out, re.MULTILINE).group(1))
    draw = float(
        re.search(r"^dashboard picture time: median ([\d.]+) s", out, re.MULTILINE).group(1)
    )
    assert cell < draw, out
