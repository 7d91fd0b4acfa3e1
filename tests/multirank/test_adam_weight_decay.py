"""Adam's weight decay as BMTrain's, sharded over 2 and 3 ranks in an OptimManager.

A wrapped model (two layers as Blocks, a head outside them: ZeRO-3 shards with
padding at 2 and 3 ranks) trains on each rank's slice of a global batch, beside the
plain model on the whole batch in one process:
  * AdamOptimizer and AdamOffloadOptimizer on fp32 parameters against torch.optim.Adam
    with weight_decay (L2, BMTrain's form for fp32), with and without a loss scale;
  * decoupled_weight_decay=True against torch.optim.AdamW;
  * torch.optim.SGD with momentum against itself (the gradients' scale shows).
Losses at every step and the final weights agree within 1e-5; a run with the other
form of the decay does not, so the comparison can fail.
"""

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

import nbtrain as nbt
from nbtrain.optim import AdamOffloadOptimizer, AdamOptimizer, OptimManager

DIM, ROWS, STEPS = 7, 6, 6  # 6 rows split over 1, 2 and 3 ranks
ADAM = dict(lr=2e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
KINDS = ("adam", "offload", "adamw", "sgd")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _batches():
    g = torch.Generator().manual_seed(11)
    return torch.randn(STEPS, ROWS, DIM, generator=g), torch.randn(STEPS, ROWS, 3, generator=g)


def _plain_optimizer(kind, params, decoupled_for_l2=False):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    l2 = kind in ("adam", "offload") and not decoupled_for_l2
    return (torch.optim.Adam if l2 else torch.optim.AdamW)(params, **ADAM)


def plain_run(kind, decoupled_for_l2=False):
    """One process, whole batches; `decoupled_for_l2` swaps in the other decay form."""
    model = Net()
    opt = _plain_optimizer(kind, model.parameters(), decoupled_for_l2)
    xs, ys = _batches()
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = ((model(xs[s]) - ys[s]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def sharded_runs(loss_scale):
    """Every kind on this rank's rows: {kind: (losses, state_dict)}. Collective."""
    return {kind: _sharded_run(kind, loss_scale) for kind in KINDS}


def _sharded_run(kind, loss_scale):
    model = nbt.wrap(Net(), zero_level=3)
    params = model.parameters()
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    elif kind == "adamw":
        opt = AdamOptimizer(params, decoupled_weight_decay=True, **ADAM)
    else:
        opt = (AdamOffloadOptimizer if kind == "offload" else AdamOptimizer)(params, **ADAM)
    manager = OptimManager(loss_scale=loss_scale)
    manager.add_optimizer(opt)
    xs, ys = _batches()
    per = ROWS // nbt.world_size()
    rows = slice(nbt.rank() * per, (nbt.rank() + 1) * per)
    losses = []
    for s in range(STEPS):
        manager.zero_grad()
        loss = ((model(xs[s, rows]) - ys[s, rows]) ** 2).mean()
        manager.backward(loss)
        assert manager.step()
        losses.append(nbt.sum_loss(loss).item())
    return losses, model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k].float() - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("loss_scale", [None, 2.0**8])
def test_weight_decay_forms_match_plain_pytorch(world, loss_scale):
    results = run_ranks(sharded_runs, world, loss_scale, timeout_s=180)
    for kind in KINDS:
        ref_losses, ref_state = plain_run(kind)
        for rank, by_kind in enumerate(results):
            losses, state = by_kind[kind]
            assert losses == pytest.approx(ref_losses, abs=1e-5), (kind, rank)
            assert _max_diff(state, ref_state) < 1e-5, (kind, rank)
        if kind in ("adam", "offload"):  # AdamW's update is far from BMTrain's fp32 one
            _, other = plain_run(kind, decoupled_for_l2=True)
            assert _max_diff(results[0][kind][1], other) > 1e-4, kind
