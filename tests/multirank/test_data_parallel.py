"""Plain parameters outside Blocks in a DistributedModule get data-parallel gradients.

A BMTrain-style model with a plain nn.Embedding, nn.LayerNorm and nn.Linear head
around sharded Blocks, trained on 2 and 3 ranks, equals one plain process on the
concatenated batch: with torch.optim.AdamW, with OptimManager + AdamOptimizer (whose
fp32 weight decay is L2, as BMTrain's: against torch.optim.Adam), and
with SGD + momentum (which, unlike Adam, sees the gradient's scale: a sum where a
mean belongs would fail here).
"""

import pytest
import torch
from lm_cases import HIDDEN, ROWS_PER_RANK, SEQ, STEPS, VOCAB, PlainLM, ShardedLM, batches
from support.ranks import run_ranks

import nbtrain as nbt
from nbtrain import telemetry
from nbtrain.comm import COUNTERS
from nbtrain.optim import AdamOptimizer, OptimManager


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "manager":
        return AdamOptimizer(params, lr=1e-2, eps=1e-6, weight_decay=0.01)
    if kind == "adam":  # AdamOptimizer's fp32 rule (BMTrain's): L2 weight decay
        return torch.optim.Adam(params, lr=1e-2, eps=1e-6, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.01)


def train(model, kind: str, xs, ys, rows=slice(None), reduce=lambda loss: loss):
    opt = make_optimizer(kind, model.parameters())
    manager = None
    if kind == "manager":
        manager = OptimManager(loss_scale=2.0**10)
        manager.add_optimizer(opt)
    losses = []
    for s in range(STEPS):
        loss = model.loss(xs[s, rows], ys[s, rows])
        if manager is None:
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            manager.zero_grad()
            manager.backward(loss)
            manager.step()
        losses.append(reduce(loss).item())
    return losses


def plain_run(world: int, kind: str):
    model = PlainLM()
    xs, ys = batches(world)
    losses = train(model, "adam" if kind == "manager" else kind, xs, ys)
    return losses, model.state_dict()


def sharded_run(kind: str, zero_level: int, nested: bool = False):
    model = ShardedLM(PlainLM(), zero_level, nested)
    # Exactly the plain parameters outside the Blocks are reduced data-parallel.
    dp = {id(p) for b in nbt.zero.ModelRoot.of(model).data_parallel.buckets for p in b.params}
    assert dp == {id(p) for m in (model.embed, model.norm, model.head) for p in m.parameters()}
    xs, ys = batches(nbt.world_size())
    rows = slice(nbt.rank() * ROWS_PER_RANK, (nbt.rank() + 1) * ROWS_PER_RANK)
    losses = train(model, kind, xs, ys, rows, reduce=nbt.sum_loss)
    # Nested adds a level to the names (layers.0.layer.fc.weight): map to the plain ones.
    return losses, {k.replace(".layer.", "."): v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "kind,zero_level,nested", [("adamw", 3, False), ("manager", 2, False), ("sgd", 3, True)]
)
def test_plain_parameters_train_like_one_process(world, kind, zero_level, nested):
    ref_losses, ref_state = plain_run(world, kind)
    for losses, state in run_ranks(sharded_run, world, kind, zero_level, nested):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)


def _reduction_events():
    model = ShardedLM(PlainLM())
    xs, ys = batches(nbt.world_size())
    rows = slice(nbt.rank() * ROWS_PER_RANK, (nbt.rank() + 1) * ROWS_PER_RANK)
    model.loss(xs[0, rows], ys[0, rows]).backward()  # first forward checks the replicas
    telemetry.RECORDER.clear()
    COUNTERS.reset()
    model.loss(xs[1, rows], ys[1, rows]).backward()
    grads_set = all(p.grad is not None for p in (model.embed.weight, model.head.weight))
    return telemetry.RECORDER.snapshot(), COUNTERS.snapshot(), grads_set


def test_buckets_are_async_overlapped_and_counted():
    for events, counters, grads_set in run_ranks(_reduction_events, 2):
        assert grads_set
        issues = {
            e["label"]: e["seq"]
            for e in events
            if e["type"] == "comm_issue" and e["label"].startswith("dp.bucket")
        }
        assert sorted(issues) == ["dp.bucket0", "dp.bucket1"]
        # The head's bucket is reduced while the blocks are still in backward.
        last_block = [
            e
            for e in events
            if e["type"] == "compute_begin"
            and e.get("phase") == "backward"
            and e["label"] == "layers.0"
        ]
        assert last_block and issues["dp.bucket0"] < last_block[0]["seq"]
        # Each bucket: its gradients plus one count per parameter, all-reduced (2x ring).
        head_norm = VOCAB * HIDDEN + VOCAB + 2 * HIDDEN + 4
        embed = VOCAB * HIDDEN + 1
        assert counters["calls"]["all_reduce"] == 2
        assert counters["bytes"]["all_reduce"] == 2 * (head_norm + embed) * 4 // 2


def _different_init():
    plain = PlainLM()
    if nbt.rank() == 1:
        with torch.no_grad():
            plain.norm.bias.add_(1.0)
    model = ShardedLM(plain)
    model.loss(torch.zeros(1, SEQ, dtype=torch.long), torch.zeros(1, SEQ, dtype=torch.long))


def test_ranks_with_different_initial_values_are_refused():
    with pytest.raises(AssertionError, match="'norm.bias' has different values on different"):
        run_ranks(_different_init, 2)
