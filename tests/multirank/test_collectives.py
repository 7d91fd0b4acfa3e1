"""Collectives: results and the byte counters benchmarks and telemetry read."""

import pytest
import torch
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain.comm import COUNTERS, all_gather, all_reduce, reduce_scatter


def _collectives():
    rank, world = nbt.rank(), nbt.world_size()
    COUNTERS.reset()
    shard = torch.full((5,), float(rank))
    full = torch.empty(5 * world)
    all_gather(full, shard)
    handle = all_gather(full2 := torch.empty(5 * world), shard + 1, async_op=True)
    handle.wait()
    grads = torch.arange(5.0 * world) * (rank + 1)
    out = torch.empty(5)
    reduce_scatter(out, grads, op="avg")
    total = torch.ones(3)
    all_reduce(total)
    return full, full2, out, total, COUNTERS.snapshot()


@pytest.mark.parametrize("world_size", [2, 3])
def test_results_and_bytes(world_size):
    mean_factor = sum(r + 1 for r in range(world_size)) / world_size
    for rank, (full, full2, out, total, counters) in enumerate(run_ranks(_collectives, world_size)):
        assert full.tolist() == [float(r) for r in range(world_size) for _ in range(5)]
        torch.testing.assert_close(full2, full + 1)
        torch.testing.assert_close(out, torch.arange(5.0 * rank, 5.0 * rank + 5) * mean_factor)
        assert total.tolist() == [world_size] * 3
        ring = (world_size - 1) / world_size
        assert counters["bytes"]["all_gather"] == 2 * int(5 * world_size * 4 * ring)
        assert counters["bytes"]["reduce_scatter"] == int(5 * world_size * 4 * ring)
        assert counters["bytes"]["all_reduce"] == 2 * int(3 * 4 * ring)
        assert counters["calls"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


def _zero3_step_bytes():
    # Only block parameters: a step moves 3 x padded param bytes x (N-1)/N (gather,
    # gather again for backward, reduce-scatter), less the last block's second gather:
    # it stays gathered from its forward into its backward.
    model = nbt.TransformerBlockList([nbt.Block(torch.nn.Linear(50, 50), 3) for _ in range(3)])
    padded = sum(g.layout.padded_numel * 4 for b in model for g in b.groups)
    last = sum(g.layout.padded_numel * 4 for g in model[-1].groups)
    COUNTERS.reset()
    model(torch.randn(2, 50)).sum().backward()
    return padded, last, COUNTERS.snapshot()["total_bytes"]


def test_zero3_step_bytes_match_theory():
    padded, last, total = run_ranks(_zero3_step_bytes, 2)[0]
    assert last > 0 and total == (3 * padded - last) // 2


def test_reduce_op_is_validated():
    with pytest.raises(ValueError, match="op='mean'"):
        from nbtrain.comm.collectives import _reduce_op

        _reduce_op("mean")


def _ring_transfers_in_flight():
    from nbtrain.comm import collectives as C

    rank, world = nbt.rank(), nbt.world_size()
    peers = dict(dst=(rank + 1) % world, src=(rank - 1) % world)
    C.IN_FLIGHT.clear()
    send, recv = torch.full((4,), float(rank)), torch.empty(4)
    works = C.send_recv([send], [recv], [0], **peers)
    registered = len(C.IN_FLIGHT)  # a send and a receive, seen by shutdown's drain
    drained = C.wait_in_flight()  # as `shutdown` does: waits for the ring's transfers
    received = recv.clone()
    C.IN_FLIGHT.discard_works(works)  # (gloo's works must not be waited on twice)
    # Through the owner's path, nothing stays registered once waited.
    C.wait_send_recv(C.send_recv([send], [torch.empty(4)], [1], **peers))
    return registered, drained, len(C.IN_FLIGHT), received


def test_ring_transfers_are_in_flight_until_waited():
    for rank, (registered, drained, left, received) in enumerate(
        run_ranks(_ring_transfers_in_flight, 2)
    ):
        assert registered == 2 and drained and left == 0
        assert torch.equal(received, torch.full((4,), float(1 - rank)))
