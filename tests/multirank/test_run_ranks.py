"""run_ranks, the tests' launcher of real gloo ranks: a rank that raises while a peer is
stuck (in a collective the raiser never joins, or in a long computation) is reported
within seconds, naming the ranks still running, instead of after the process-group
timeout or the run's deadline."""

import time

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks

from nbtrain.launch import ERROR_GRACE_S


def _rank0_gives_up():
    import nbtrain

    if nbtrain.rank() == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(150)  # stuck: no error of its own for a long while
    dist.all_reduce(torch.ones(1))
    return "done"


def test_a_rank_that_raises_is_reported_without_waiting_for_its_peers():
    began = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run_ranks(_rank0_gives_up, 2, timeout_s=180, pg_timeout_s=150)
    took = time.monotonic() - began
    message = str(err.value)
    assert "rank(s) [0] raised (rank(s) [1] still running" in message, message
    assert "ValueError: rank 0 gives up" in message, message
    assert took < ERROR_GRACE_S + 25, took  # not the 150 s process-group timeout


def _every_rank_raises():
    import nbtrain

    raise ValueError(f"rank {nbtrain.rank()} refuses")


def test_when_every_rank_raises_every_rank_is_named():
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1, 2\] raised; rank 0:"):
        run_ranks(_every_rank_raises, 3, timeout_s=120)
