"""`%nbtrain debug` in a real Jupyter kernel (nbclient): a cell raises on rank 1 only,
then an expression evaluated in rank 1's failing frame shows that frame's local value,
and rank 0's namespace is as the cell left it; no process is left after the kernel."""

import pytest

for _needed in ("nbformat", "nbclient", "ipyparallel"):
    pytest.importorskip(_needed)

from procs import wait_gone
from support.kernels import START, new_client, pids_from, run_cells, text_of

pytestmark = pytest.mark.timeout(300)

FAILING_CELL = """\
%%distributed
def step(rank):
    secret = 40 + rank
    if rank == 1:
        raise ValueError(f"rank {rank} failed")
    return secret

result = step(nbt.rank())
"""


def test_debug_evaluates_in_the_failing_frame_in_a_real_kernel():
    nb, client = new_client()
    with client.setup_kernel():
        pids = pids_from(run_cells(client, nb, START)[-1])
        failed, listed, evaluated, rank0 = run_cells(
            client,
            nb,
            [
                FAILING_CELL,
                "%nbtrain debug",
                "%nbtrain debug --rank 1 secret * 100",
                "%%distributed -t 0\nprint('result', result)",
            ],
        )
        assert "rank 1 failed" in text_of(failed), text_of(failed)
        assert "rank 1 raised ValueError: rank 1 failed" in text_of(listed), text_of(listed)
        assert "in step" in text_of(listed) and "secret  int 41" in text_of(listed)
        assert text_of(evaluated).strip() == "4100", text_of(evaluated)
        assert "error" not in [o.output_type for o in evaluated.outputs + rank0.outputs]
        assert "[rank 0] result 40" in text_of(rank0), text_of(rank0)
    assert wait_gone(pids) == []  # the kernel's shutdown stops every rank it started
