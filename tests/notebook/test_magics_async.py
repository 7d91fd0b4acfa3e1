"""`%%distributed --noblock`, `%nbtrain wait|result` and `%autodistributed`.

Real IPython shell, 2 real gloo ranks shared by the module (start costs ~10 s on 2
cores); the module's fixture stops the cluster at the end.
"""

import time

import pytest

# The notebook packages ([notebook]/[test] extras) may be absent, e.g. on a bare GPU machine
# running only `pytest -m gpu`: skip this module there rather than fail collection.
for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
from IPython.utils.capture import capture_output
from support.notebook import Gate, captured, nbtrain

from nbtrain import RankError
from nbtrain.notebook import magics
from nbtrain.notebook.autodistribute import autodistribute, autodistributed_on
from nbtrain.notebook.errors import DistributedError

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------- help (no cluster)
def test_help_lists_wait_result_and_block_flags():
    doc = magics.NbtrainMagics.nbtrain.__doc__
    for action in ("wait", "result"):
        assert f"\n  {action}" in doc, action
    cell_doc = magics.NbtrainMagics.distributed.__doc__
    assert "--block" in cell_doc and "--noblock" in cell_doc
    assert "%autodistributed" in magics.NbtrainMagics.autodistributed.__doc__


def test_autodistribute_transformer_leaves_magics_and_shell_alone():
    t = autodistribute
    assert t(["x = 1\n"]) == ["%%distributed\n", "x = 1\n"]
    assert t(["\n", "  y = 2\n"])[0] == "%%distributed\n"
    for lines in (
        ["%autodistributed off\n"],
        ["%%time\n", "x = 1\n"],
        ["!ls\n"],
        [],
        ["\n"],
        ["  %nbtrain status\n"],
    ):
        assert t(lines) == lines


# ------------------------------------------------------------- on the cluster
def test_noblock_cell_frees_the_kernel_then_wait_collects_it(ipython, cluster, tmp_path):
    ipython.user_ns.pop("slept", None)
    # The ranks wait for the gate (60 s at most): a magic that waited for the cell
    # would take that long, and then find it done.
    gate = Gate(tmp_path)
    start = time.monotonic()
    _, out = captured(
        ipython,
        "distributed",
        "--noblock",
        gate.hold() + "slept = nbt.rank() + 100\nprint('woke', nbt.rank())",
    )
    assert time.monotonic() - start < 6, "--noblock waited for the cell"
    assert "running on ranks 0, 1" in out and "%nbtrain wait" in out
    # the kernel is free: local code runs, and status answers without blocking
    ipython.run_cell("local_value = 6 * 7")
    assert ipython.user_ns["local_value"] == 42
    t0 = time.monotonic()
    _, status = captured(ipython, "nbtrain", "status")
    assert time.monotonic() - t0 < 6, "status waited for the cell"
    rows = status.splitlines()[1:3]
    assert all(row.rstrip().endswith("busy") for row in rows), status
    assert "still running on ranks 0, 1" in status
    # another cell, push and pull are refused until the cell is collected
    with pytest.raises(DistributedError, match=r"still running on ranks 0, 1.*%nbtrain wait"):
        ipython.run_cell_magic("distributed", "", "print('too soon')")
    with pytest.raises(DistributedError, match="%nbtrain wait"):
        nbtrain(ipython, "pull slept")
    # result does not wait
    t0 = time.monotonic()
    _, out = captured(ipython, "nbtrain", "result")
    assert time.monotonic() - t0 < 6 and "still running on ranks 0, 1" in out
    assert not cluster.pending.done()  # everything above ran while the ranks waited
    gate.open()
    _, out = captured(ipython, "nbtrain", "wait")
    assert "[rank 0] woke 0" in out and "[rank 1] woke 1" in out
    assert time.monotonic() - start < 50, "the ranks waited out the gate's limit"
    assert nbtrain(ipython, "pull slept") == [100, 101]
    assert "slept" not in ipython.user_ns
    assert cluster.pending is None
    _, out = captured(ipython, "distributed", "--block", "print('blocking again')")
    assert out.count("blocking again") == 2


def test_wait_timeout_stops_waiting_and_the_cell_runs_on(ipython, cluster, tmp_path):
    gate = Gate(tmp_path)
    captured(ipython, "distributed", "--noblock -t 1", gate.hold() + "print('late')")
    t0 = time.monotonic()
    _, out = captured(ipython, "nbtrain", "wait --timeout 0.3")
    assert time.monotonic() - t0 < 4 and "still running on ranks 1" in out
    assert not cluster.pending.done()
    gate.open()
    _, out = captured(ipython, "nbtrain", "wait")
    assert "[rank 1] late" in out and "[rank 0]" not in out


def test_errors_of_a_noblock_cell_are_raised_by_result_and_wait(ipython, cluster):
    with pytest.raises(DistributedError, match="no non-blocking cell"):
        nbtrain(ipython, "wait")
    captured(ipython, "distributed", "--noblock", "print('before')\n1 / (nbt.rank() - 1)")
    deadline = time.monotonic() + 30
    while not cluster.pending.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    with capture_output() as cap, pytest.raises(RankError) as info:
        nbtrain(ipython, "result")
    assert info.value.ranks == [1] and "ZeroDivisionError" in str(info.value)
    assert "[rank 0] before" in cap.stdout and "[rank 1] before" in cap.stdout
    assert cluster.pending is None
    captured(ipython, "distributed", "--noblock", "raise ValueError('boom')")
    with pytest.raises(RankError, match="boom"):
        nbtrain(ipython, "wait")


def test_autodistributed_runs_plain_cells_on_the_ranks(ipython, cluster):
    ipython.user_ns.pop("x", None)
    captured(ipython, "autodistributed", "on")
    assert autodistributed_on(ipython)
    with capture_output() as cap:
        result = ipython.run_cell("x = nbt.rank()\nprint('on rank', x)")
    assert result.success, result.error_in_exec
    assert "[rank 0] on rank 0" in cap.stdout and "[rank 1] on rank 1" in cap.stdout
    assert "x" not in ipython.user_ns
    # magics still run locally while it is on
    assert ipython.run_cell("%nbtrain pull x").result == [0, 1]
    ipython.run_cell("%autodistributed off")
    assert not autodistributed_on(ipython)
    ipython.run_cell("x = 'local'")
    assert ipython.user_ns["x"] == "local"
    assert nbtrain(ipython, "pull x") == [0, 1]
    captured(ipython, "autodistributed", "")  # toggles on
    assert autodistributed_on(ipython)
    captured(ipython, "autodistributed", "")  # and off
    assert not autodistributed_on(ipython)


def test_dashboard_updates_while_a_noblock_cell_runs(ipython, cluster, tmp_path):
    from nbtrain.notebook.dashboard import Dashboard

    gate = Gate(tmp_path)  # the ranks step until it opens (at most 400 steps, 40 s)
    with capture_output():
        board = Dashboard().show()
        ipython.run_cell_magic(
            "distributed",
            "--noblock",
            f"import os, time\nfor i in range(400):\n    if os.path.exists({str(gate.path)!r}):\n"
            "        break\n"
            "    nbt.telemetry.metric(loss=10.0 - i)\n"
            "    nbt.telemetry.next_step()\n    time.sleep(0.1)",
        )
    try:
        deadline = time.monotonic() + 8
        steps = {}
        while time.monotonic() < deadline and not cluster.pending.done():
            steps = {r: (s or {}).get("step", 0) for r, s in board.summaries.items()}
            if len(steps) == 2 and min(steps.values()) >= 3:
                break
            time.sleep(0.2)
        assert not cluster.pending.done(), "the cell ended before the dashboard was checked"
        assert len(steps) == 2 and min(steps.values()) >= 3, steps  # fed while running
    finally:
        gate.open()
        with capture_output():
            nbtrain(ipython, "wait")
