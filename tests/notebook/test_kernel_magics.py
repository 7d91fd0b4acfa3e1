"""The magics in a real Jupyter kernel (nbclient): push and pull, target slices, a
--noblock cell with status read while it runs, %autodistributed, restart -n, and
IPython's UsageError for bad usage; no process left after the kernel goes."""

import pytest

for _needed in ("nbformat", "nbclient", "ipyparallel"):
    pytest.importorskip(_needed)

from procs import wait_gone
from support.kernels import START, new_client, pids_from, run_cells, text_of
from support.notebook import Gate

pytestmark = pytest.mark.timeout(300)


def test_magics_in_a_real_kernel(tmp_path):
    nb, client = new_client()
    with client.setup_kernel():
        pids = pids_from(run_cells(client, nb, START)[-1])
        push, pulled, sliced = run_cells(
            client,
            nb,
            [
                "lr = 0.25\n%nbtrain push lr",
                "%%distributed\nscaled = lr * (nbt.rank() + 1)",
                "%%distributed -t 1:\nprint('on', nbt.rank())",
            ],
        )
        assert "error" not in [o.output_type for c in (push, pulled, sliced) for o in c.outputs]
        assert "[rank 1] on 1" in text_of(sliced) and "[rank 0]" not in text_of(sliced)
        (value,) = run_cells(client, nb, ["%nbtrain pull scaled"])
        assert "[0.25, 0.5]" in text_of(value)

        gate = Gate(tmp_path)  # the ranks wait for it: the kernel is free meanwhile
        submitted, status = run_cells(
            client,
            nb,
            ["%%distributed --noblock\n" + gate.hold() + "print('slept')", "%nbtrain status"],
        )
        gate.open()
        (waited,) = run_cells(client, nb, ["%nbtrain wait"])
        assert "without blocking" in text_of(submitted)
        assert text_of(status).count("busy") == 2, text_of(status)
        assert text_of(waited).count("slept") == 2

        on, auto, off, local = run_cells(
            client,
            nb,
            [
                "%autodistributed on",
                "print('auto on', nbt.rank())",
                "%autodistributed off",
                "print('local again')",
            ],
        )
        assert "[rank 0] auto on 0" in text_of(auto) and "[rank 1] auto on 1" in text_of(auto)
        assert "[rank" not in text_of(local) and "local again" in text_of(local)

        (bad,) = run_cells(client, nb, ["%nbtrain pull"])
        # IPython prints a UsageError as one line, no traceback
        assert "UsageError: %nbtrain pull: name the variable" in text_of(bad), text_of(bad)
        assert "Traceback" not in text_of(bad)

        # Growing from 2 ranks to 3: test_magics_usage.py's restart test only shrinks
        # (to 1) and counts on this one for the other direction.
        restarted, counted = run_cells(
            client,
            nb,
            [
                "%nbtrain restart -n 3",
                "import nbtrain.notebook.magics as _m\nprint('PIDS', *_m.current_cluster().pids())\n"
                "print('ranks', _m.current_cluster().world_size)",
            ],
        )
        assert "3 fresh ranks" in text_of(restarted)
        assert "ranks 3" in text_of(counted)
        pids += pids_from(counted)
    assert wait_gone(pids) == []  # the kernel's shutdown stops every rank it started
