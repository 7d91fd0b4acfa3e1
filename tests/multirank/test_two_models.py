"""Two sharded models in one process (a teacher and a student, or a model rebuilt by
re-running the cell that built it) train independently, each equal to its plain twin.

Their steps interleave: both forwards, then both backwards, then both optimizer
steps, so each model's reductions are in flight while the other computes.
"""

import pytest
import torch
from lm_cases import ROWS_PER_RANK, STEPS, PlainLM, ShardedLM, batches
from support import cases
from support.ranks import run_ranks

import nbtrain as nbt


def _gpt_batches(world: int):
    return cases.batches(world, STEPS)


def _step_pair(models, opts, data, rows, reduce):
    losses = [model.loss(x[rows], y[rows]) for model, (x, y) in zip(models, data)]
    for opt in opts:
        opt.zero_grad()
    for loss in losses:
        loss.backward()
    for opt in opts:
        opt.step()
    return [reduce(loss).item() for loss in losses]


def _train_pair(gpt, lm, world: int, rows, reduce=lambda loss: loss):
    opts = [
        torch.optim.SGD(gpt.parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(lm.parameters(), lr=1e-2, eps=1e-6),
    ]
    gx, gy = _gpt_batches(world)
    lx, ly = batches(world)
    history = []
    for s in range(STEPS):
        history.append(_step_pair([gpt, lm], opts, [(gx[s], gy[s]), (lx[s], ly[s])], rows, reduce))
    return history, gpt.state_dict(), lm.state_dict()


def _plain(world: int):
    return _train_pair(cases.plain_model(), PlainLM(seed=1), world, slice(None))


def _sharded(zero_level: int):
    rank, world = nbt.rank(), nbt.world_size()
    # The first pair is dropped half-way, as when a notebook cell is re-run: the
    # rebuilt models must not share any state with the old ones.
    old_gpt = cases.sharded_model("wrap", zero_level, False)
    old_lm = ShardedLM(PlainLM(seed=1), zero_level)
    _step_pair(
        [old_gpt, old_lm],
        [
            torch.optim.SGD(old_gpt.parameters(), lr=0.1),
            torch.optim.SGD(old_lm.parameters(), lr=0.1),
        ],
        [(x[0], y[0]) for x, y in (_gpt_batches(world), batches(world))],
        slice(0, 1),
        nbt.sum_loss,
    )
    gpt = cases.sharded_model("wrap", zero_level, False)
    lm = ShardedLM(PlainLM(seed=1), zero_level)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    assert cases.BATCH_PER_RANK == ROWS_PER_RANK
    return _train_pair(gpt, lm, world, rows, nbt.sum_loss)


@pytest.mark.parametrize("world,zero_level", [(2, 3), (3, 2)])
def test_two_models_train_independently(world, zero_level):
    ref_history, ref_gpt, ref_lm = _plain(world)
    for history, gpt_state, lm_state in run_ranks(_sharded, world, zero_level):
        flat = [loss for pair in history for loss in pair]
        assert flat == pytest.approx([loss for pair in ref_history for loss in pair], abs=1e-5)
        for state, ref in ((gpt_state, ref_gpt), (lm_state, ref_lm)):
            for name, value in ref.items():
                torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
