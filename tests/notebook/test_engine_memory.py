"""Engines that live for thousands of cells keep their memory per cell bounded: the
short version of `tests/stress/engine_memory.py` (1,000 cells on 3 ranks), run in CI.

A real kernel, 2 gloo ranks, the dashboard shown, 120 training cells of a ZeRO-3 GPT
with cells that fail on one rank mid-step and cells stopped by the kernel's interrupt
among them. After 20 cells of warm-up (a failure on each rank, a stop), over the 100
cells that follow the kernel's widgets grow by at most one bar's 11 (11 a cell before) and each engine's
gloo threads by at most one group's (3 a failure before, one loop spinning a core).
RSS is printed and only checked against a gross bound (32 MiB): in a run this short
the bounded buffers are still filling, and an engine grew 7.2-9.1 MiB, the kernel
7.9-9.5 MiB (the old code: 8.6-8.9 and 16.1); the goal, 4 and 16 MiB after the warm-up,
is the long command's (1000 cells: +2.4-2.6 and +8.3 MiB). Against the old code this
test fails by its counts: widgets 327 -> 1427, gloo threads 6 -> 12.
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ipyparallel")
pytest.importorskip("jupyter_client")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(600)


def test_engines_and_kernel_grow_within_bounds_over_a_hundred_cells():
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tests", "stress", "engine_memory.py"),
        "--cells", "120", "--warmup", "20", "--ranks", "2", "--errors", "3",
        "--interrupts", "3", "--max-engine-mib", "32", "--max-kernel-mib", "32", "--every", "40",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    report = done.stdout[done.stdout.find("engine memory:") :]
    print(done.stdout[-4000:])
    assert "engine memory:" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cells that went wrong: 0" in report, report
    assert "processes left over: 0" in report, report
    # What grew per cell or per failure before, counted: the kernel's widgets (11 a
    # cell) and each engine's gloo threads (3 a failure, one spinning a core).
    # (Once one bar's 11 stayed over a run: not yet explained; 100 cells left 1100.)
    ((was, now),) = re.findall(r"widgets: (\d+) -> (\d+)", report)
    assert int(now) <= int(was) + 11, report
    for was, now in re.findall(r"gloo threads: (\d+) -> (\d+)", report):
        assert int(now) <= int(was) + 3, report
    assert done.returncode == 0, report


def test_an_engines_shell_keeps_the_last_hundred_cells(ipython, cluster):
    """Older cells' sources leave the input history, `_iN` and linecache (In[n] still
    indexes cell n); a function defined long ago keeps its source for tracebacks."""
    from support.notebook import run

    run(ipython, "def old_function():\n    raise ValueError('from an old cell')")
    first = int(run(ipython, "print(get_ipython().execution_count)").split()[-1])
    for i in range(110):
        run(ipython, f"x = {i}")
    out = run(
        ipython,
        "import linecache, traceback\nip = get_ipython()\nn = ip.execution_count\n"
        "names = ip.compile._filename_map\n"
        "cached = sorted(v for k, v in names.items() if k in linecache.cache)\n"
        f"print('old', repr(In[{first}]), '_i{first}' in globals(), {first} in cached)\n"
        "m = len(In) - 2  # the cell before this one (In ends with this one)\n"
        "print('new', repr(In[m]), f'_i{m}' in globals(), m in cached)\n"
        "try:\n    old_function()\nexcept ValueError:\n"
        "    print('frame', traceback.format_exc().count('raise ValueError'))",
    )
    for r in (0, 1):
        assert f"[rank {r}] old '' False False" in out, out
        assert f"[rank {r}] new 'x = 109' True True" in out, out
        assert f"[rank {r}] frame 1" in out, out  # the defining cell's line is shown


def test_restarts_with_dashboards_leave_the_kernel_bounded():
    """`tests/stress/restart_memory.py` short: each round a `--dashboard` training cell
    and `%nbtrain restart`; a round left 118 widgets and 5.5-7.6 MiB in the kernel
    (old dashboards kept their histories and curves): now the old board's table and
    picture (7 widgets), and well under 1 MiB. It counts the widgets outside the dashboard
    shown now: that one's own count varied by 14 with when its live panels first got data."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "stress", "restart_memory.py")]
    # RSS settles over the first rounds on a loaded machine (CI: +2.2, +0.7, +0.3 MiB from
    # the second round): 2.5 MiB a round here, against 5.5-7.6 before; the widgets are
    # the sharp check (+118 a round before).
    args = ["--rounds", "5", "--max-mib-a-round", "2.5"]
    done = subprocess.run(cmd + args, capture_output=True, text=True, timeout=400)
    print(done.stdout[-2000:])
    assert "restart memory:" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, done.stdout[-2000:]
