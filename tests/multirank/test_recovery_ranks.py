"""nbtrain.comm.recovery on real gloo ranks, without the notebook: the abort key frees
a rank blocked in a collective, the group is rebuilt, a graceful stop ends every
rank's loop at the same step, and a cut optimizer step is reported."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from support.ranks import run_ranks


def _watcher_frees_a_blocked_rank(alone: bool):
    from nbtrain.comm import recovery

    assert recovery.arm(60)
    rank = dist.get_rank()
    kept = torch.full((2,), float(rank))
    elapsed = None
    if rank == 1:
        held = dist.group.WORLD  # e.g. kept alive by a traceback's frames
        if alone:  # rank 0's watcher alone must free it (as for a peer that hangs)
            recovery._stop_watcher()
        # Write the abort key, as a failing rank does; the watchers (rank 0's, and this
        # rank's own, which closes its sockets) free rank 0 from the all_reduce.
        recovery._S.store.compare_set(recovery._key("abort"), "", "rank 1: planted")
        time.sleep(3.0)
        origin = recovery.failed_first() or "rank 1: planted"
        del held
    else:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except Exception:
            elapsed = time.monotonic() - start
        # What the notebook's error handler does: whichever watcher freed this rank,
        # the first writer of the abort key is the origin.
        origin = recovery.fail("all_reduce failed")
    recovery.rebuild()
    total = torch.ones(1)
    dist.all_reduce(total)
    recovery.disarm()
    return {"elapsed": elapsed, "origin": origin, "sum": total.item(), "kept": kept.tolist()}


@pytest.mark.parametrize("alone", [False, True], ids=["both-watchers", "its-own-watcher"])
def test_abort_key_frees_a_blocked_rank_and_the_group_is_rebuilt(alone):
    # Both ranks keep the group alive (rank 0's Work, rank 1's reference): aborting it
    # does not close gloo's connections, so the watchers must.
    r0, r1 = run_ranks(_watcher_frees_a_blocked_rank, 2, alone, timeout_s=120)
    assert r0["elapsed"] is not None and r0["elapsed"] < 2.0  # not the 60 s timeout
    assert r0["origin"] == r1["origin"] == "rank 1: planted"
    assert r0["sum"] == r1["sum"] == 2.0
    assert r0["kept"] == [0.0, 0.0] and r1["kept"] == [1.0, 1.0]


def _graceful_stop_at_one_step():
    import nbtrain
    from nbtrain.comm import recovery

    assert recovery.arm(60)
    last = -1
    x = torch.ones(1)
    for n in nbtrain.progress(range(10**6), print_s=600):
        if dist.get_rank() == 0 and n == 20:
            os.kill(os.getpid(), signal.SIGINT)  # the stop button, on one rank only
        dist.all_reduce(x)
        x.fill_(1.0)
        last = n
    dist.barrier()  # both left the loop at a boundary: the group still works
    recovery.disarm()
    return last


def test_graceful_stop_ends_every_rank_at_the_same_step():
    last = run_ranks(_graceful_stop_at_one_step, 2, timeout_s=120)
    assert last[0] == last[1] and 20 < last[0] < 10**6 - 1


def _optim_manager_stops_at_the_next_boundary(clip: bool):
    import nbtrain
    from nbtrain.comm import recovery

    nbtrain.init_distributed()
    assert recovery.arm(60)
    torch.manual_seed(0)
    model = nbtrain.wrap(torch.nn.Linear(4, 4), zero_level=3)
    manager = nbtrain.optim.OptimManager(loss_scale=None)
    manager.add_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    last = -1
    for n in nbtrain.progress(range(10**6), print_s=600):
        if dist.get_rank() == 1 and n == 20:
            os.kill(os.getpid(), signal.SIGINT)  # the stop button, on one rank only
        manager.zero_grad()
        manager.backward(model(torch.ones(2, 4)).square().mean())
        if clip:  # the norm's all-reduce stands in for the overflow check's
            manager.clip_grad_norm(1e9)
        manager.step()
        last = n
    dist.barrier()
    recovery.disarm()
    return last


@pytest.mark.parametrize("clip", [False, True], ids=["overflow-check", "clip-grad-norm"])
def test_a_stop_known_to_one_rank_ends_every_loop_at_the_next_boundary(clip):
    """OptimManager's per-step all-reduce carries the stop, so every rank learns of it
    in the step it was asked in, not a second of steps later."""
    last = run_ranks(_optim_manager_stops_at_the_next_boundary, 2, clip, timeout_s=120)
    assert last == [20, 20]


def _cut_optimizer_step():
    from nbtrain.comm import recovery

    assert recovery.arm(60)

    class HalfStep(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            raise RuntimeError("cut")

    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    torch.optim.SGD([w], lr=0.1).step()  # a whole step leaves no phase behind
    before = recovery.interrupted_phase()
    try:
        HalfStep([w], lr=0.1).step()
    except RuntimeError:
        pass
    during = recovery.interrupted_phase()
    recovery.fail("cut")
    recovery.rebuild()
    after = recovery.interrupted_phase()
    recovery.disarm()
    return before, during, after


def test_a_cut_optimizer_step_is_reported_until_the_rebuild():
    for before, during, after in run_ranks(_cut_optimizer_step, 2, timeout_s=120):
        assert before is None and after is None
        assert during == "HalfStep.step() (the optimizer update)"
