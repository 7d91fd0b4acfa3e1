"""The extension in a real Jupyter kernel driven by nbclient: live cells, a figure
from a rank, an error naming its rank, Ctrl-C, and no orphan after the kernel goes
(shut down, or killed outright)."""

import glob
import os
import signal
import time

import pytest

# The notebook packages ([notebook]/[test] extras) may be absent, e.g. on a bare GPU machine
# running only `pytest -m gpu`: skip this module there rather than fail collection.
for _needed in ("nbformat", "nbclient", "ipyparallel"):
    pytest.importorskip(_needed)

from procs import signal_when, wait_gone
from support.kernels import START, new_client, pids_from, run_cells, text_of

pytestmark = pytest.mark.timeout(240)


def test_kernel_cells_errors_interrupt_and_shutdown(tmp_path):
    nb, client = new_client()
    with client.setup_kernel():
        _, _, pids_cell = run_cells(client, nb, START)
        pids = pids_from(pids_cell)
        reduce_cell, figure_cell, error_cell = run_cells(
            client,
            nb,
            [
                "%%distributed\nx = torch.ones(2) * (nbt.rank() + 1)\n"
                "torch.distributed.all_reduce(x)\nprint('reduced', x.tolist())",
                "%%distributed -t 0\nimport matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()",
                "%%distributed\nif nbt.rank() == 1:\n    raise KeyError('missing on one rank')",
            ],
        )
        assert "[rank 0] reduced [3.0, 3.0]" in text_of(reduce_cell)
        assert "[rank 1] reduced [3.0, 3.0]" in text_of(reduce_cell)
        assert any("image/png" in o.get("data", {}) for o in figure_cell.outputs)
        error = text_of(error_cell)
        assert "rank 1 raised" in error and "KeyError" in error and "rank 0 raised" not in error

        # What Jupyter's stop button does to a local kernel (interrupt_mode "signal"),
        # pressed once both ranks are in the loop (each writes its file after its first
        # all_reduce) rather than after a fixed 3 s of both ranks spinning.
        looping = [tmp_path / f"looping-{rank}" for rank in range(2)]
        sent = signal_when(
            lambda: all(f.exists() for f in looping),
            client.km.provisioner.process.pid,
            signal.SIGINT,
        )
        # A loop of collectives: every rank stops, the group is rebuilt, nothing is lost.
        (interrupted,) = run_cells(
            client,
            nb,
            [
                "%%distributed\nkept = 40 + nbt.rank()\n"
                "x = torch.ones(2)\ntorch.distributed.all_reduce(x)\n"
                f"open({str(tmp_path)!r} + f'/looping-{{nbt.rank()}}', 'w').close()\n"
                "while True:\n"
                "    torch.distributed.all_reduce(x)\n"
                "    x.fill_(1)"
            ],
        )
        # Within 17 s of the stop button: the 20 s from the cell's start this allowed
        # when the button was pressed 3 s after the start.
        assert sent and time.monotonic() - sent[0] < 17
        assert "KeyboardInterrupt" in text_of(interrupted)
        (after,) = run_cells(
            client,
            nb,
            [
                "%%distributed\nx = torch.ones(1)\n"
                "torch.distributed.all_reduce(x)\n"
                "print('still here', nbt.rank(), kept, x.item())"
            ],
        )
        assert "[rank 0] still here 0 40 2.0" in text_of(after)
        assert "[rank 1] still here 1 41 2.0" in text_of(after)
        assert wait_gone(pids, timeout_s=0.1) == pids  # all alive before the kernel goes
    # Leaving setup_kernel shuts the kernel down gracefully, as Jupyter's shutdown does.
    assert wait_gone(pids) == []


def cluster_files() -> set:
    return set(
        glob.glob(
            os.path.join(
                os.environ["IPYTHONDIR"], "profile_*", "security", "cluster-nbtrain-*.json"
            )
        )
    )


def test_killed_kernel_leaves_no_orphan():
    nb, client = new_client()
    before = cluster_files()
    with client.setup_kernel():
        _, _, pids_cell = run_cells(client, nb, START)
        pids = pids_from(pids_cell)
        assert len(cluster_files() - before) == 1
        os.kill(client.km.provisioner.process.pid, signal.SIGKILL)
        assert wait_gone(pids) == []
        deadline = time.monotonic() + 10  # nor a cluster file naming the dead cluster
        while cluster_files() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster_files() - before == set()
