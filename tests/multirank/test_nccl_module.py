"""`nbtrain.nccl`, BMTrain's communicator module, on real gloo ranks at world 2 and 3:
each call against the result computed on one process from every rank's input, with
BMTrain's argument order and communicators from config (the whole world, a tp group)."""

import pytest
import torch
from support.ranks import run_ranks


def _inputs(world):
    return [torch.arange(6, dtype=torch.float32) * (r + 1) + r for r in range(world)]


def _calls():
    import nbtrain as bmt
    from nbtrain import nccl

    rank, world, comm = bmt.rank(), bmt.world_size(), bmt.config["comm"]
    x = _inputs(world)[rank]
    out = {"count": nccl.commCount(comm), "rank": nccl.commRank(comm)}
    for op in ("sum", "avg", "max", "prod"):
        dst = torch.empty_like(x)
        nccl.allReduce(x.storage(), dst.storage(), op, comm)  # storages, as BMTrain's callers
        out[f"allReduce {op}"] = dst
    inplace = x.clone()
    nccl.allReduce(inplace, inplace, "sum", comm)
    out["allReduce in place"] = inplace
    gathered = torch.empty(6 * world)
    nccl.allGather(x, gathered, comm)
    out["allGather"] = gathered
    full = torch.arange(6.0 * world) * (rank + 1)
    part = torch.empty(6)
    nccl.reduceScatter(full, part, "sum", comm)
    out["reduceScatter"] = part
    got = torch.zeros(6)
    nccl.broadcast(x, got, world - 1, comm)
    out["broadcast"] = got
    reduced = torch.full((6,), -1.0)
    nccl.reduce(x, reduced, "max", 0, comm)
    out["reduce"] = reduced
    # a ring: every rank sends to the next and receives from the previous, in one group
    recv = torch.empty(6)
    nccl.groupStart()
    nccl.send(x, (rank + 1) % world, comm)
    nccl.recv(recv, (rank - 1) % world, comm)
    nccl.groupEnd()
    out["ring"] = recv
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bmtrains_calls_give_one_process_results(world):
    out = run_ranks(_calls, world, timeout_s=120)
    xs = torch.stack(_inputs(world))
    for rank, got in enumerate(out):
        assert got["count"] == world and got["rank"] == rank
        torch.testing.assert_close(got["allReduce sum"], xs.sum(0))
        torch.testing.assert_close(got["allReduce avg"], xs.mean(0))
        torch.testing.assert_close(got["allReduce max"], xs.max(0).values)
        torch.testing.assert_close(got["allReduce prod"], xs.prod(0))
        torch.testing.assert_close(got["allReduce in place"], xs.sum(0))
        torch.testing.assert_close(got["allGather"], xs.reshape(-1))
        fulls = torch.stack([torch.arange(6.0 * world) * (r + 1) for r in range(world)])
        torch.testing.assert_close(got["reduceScatter"], fulls.sum(0)[rank * 6 : rank * 6 + 6])
        torch.testing.assert_close(got["broadcast"], xs[world - 1])
        expected = xs.max(0).values if rank == 0 else torch.full((6,), -1.0)
        torch.testing.assert_close(got["reduce"], expected)
        torch.testing.assert_close(got["ring"], xs[(rank - 1) % world])


def _bad_calls():
    from nbtrain import nccl

    errors = []
    for call in (
        lambda: nccl.allReduce(torch.ones(3), torch.ones(4), "sum", None),
        lambda: nccl.allReduce(torch.ones(3), torch.ones(3), "mean", None),
        lambda: nccl.commInitRank(b"", 2, 0),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, NotImplementedError) as err:
            errors.append(str(err))
    return errors


def test_bad_arguments_name_the_fix():
    sizes, op, init = run_ranks(_bad_calls, 1, timeout_s=60)[0]
    assert "dst has 4 elements, expected 3" in sizes
    assert "op='mean'" in op and "'avg'" in op
    assert "torch.distributed.new_group" in init
