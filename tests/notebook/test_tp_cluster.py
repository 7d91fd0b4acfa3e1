"""`%nbtrain start -n 2 --tp-size 2`: the topology on every engine, coordinates in the output."""

import pytest

for _needed in ("IPython", "ipyparallel"):
    pytest.importorskip(_needed)
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from procs import wait_gone

from nbtrain.notebook import magics

pytestmark = pytest.mark.timeout(240)


def test_tp_that_does_not_divide_the_ranks_is_a_usage_error(ipython):
    with pytest.raises(UsageError, match=r"--tp-size 3 must divide the number of ranks \(4\)"):
        ipython.run_line_magic("nbtrain", "start -n 4 --tp-size 3")
    assert magics.current_cluster() is None  # nothing was started


def test_tensor_parallel_cluster(ipython):
    ipython.run_line_magic("nbtrain", "start -n 2 --tp-size 2 --backend gloo --start-timeout-s 90")
    cluster = magics.current_cluster()
    pids = cluster.pids()
    try:
        with capture_output() as cap:
            ipython.run_cell_magic(
                "distributed",
                "",
                (
                    "from nbtrain.nn import ColumnParallelLinear\n"
                    "torch.manual_seed(0)\n"
                    "layer = ColumnParallelLinear(4, 6, gather_output=True)\n"
                    "torch.manual_seed(0)\n"
                    "plain = torch.nn.Linear(4, 6)\n"
                    "x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))\n"
                    "y = layer(x.chunk(2)[nbt.config['tp_rank']])\n"
                    "print('tp', nbt.config['tp_size'], nbt.config['tp_rank'],\n"
                    "      'err', float((y - plain(x)).abs().max()) < 1e-6)"
                ),
            )
        assert "[rank 0 tp0 dp0] tp 2 0 err True" in cap.stdout
        assert "[rank 1 tp1 dp0] tp 2 1 err True" in cap.stdout
        with pytest.raises(
            UsageError,
            match=r"restart -n 3: the cluster has tensor-parallel "
            r"size 2",
        ):
            ipython.run_line_magic("nbtrain", "restart -n 3")
        assert cluster.running and cluster.pids() == pids  # nothing was restarted
    finally:
        ipython.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []
