"""BMTrain's Block defaults, at 1, 2 and 3 ranks, against plain PyTorch.

Every Block here is built as a BMTrain script builds one, `Block(layer)` with no other
argument, so what is checked is the default:
  * it checkpoints: a block that trains runs its layer twice a step (forward, and again
    in backward), as BMTrain's `use_checkpoint=True`;
  * a block none of whose parameters trains, fed an input that needs no gradient,
    runs its layer once and returns an output without a grad_fn (it costs no gradient);
  * a layer returning a list comes back as a tuple;
  * with the first two blocks frozen whole, the others train as the plain model with
    the same blocks frozen, with SGD (momentum) and AdamW, each rank on its slice of the
    batch: the loss at every step and every weight at the end equal the reference's.
"""

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

import nbtrain as bmt

DIM, ROWS_PER_RANK, LAYERS, FROZEN, STEPS = 5, 2, 4, 2, 4


class Layer(nn.Module):
    """A linear layer that counts its forward calls and returns a list (BMTrain's
    Block gives a tuple back)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return [torch.tanh(self.fc(x))]


class Model(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            (x,) = layer(x)
        return x


def _plain_layers():
    torch.manual_seed(0)
    return [Layer() for _ in range(LAYERS)]


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


def _batches(world):
    torch.manual_seed(1)
    return [torch.randn(world * ROWS_PER_RANK, DIM) for _ in range(STEPS)]


def _train(model, layers, batches, kind, rows):
    for layer in layers[:FROZEN]:
        layer.requires_grad_(False)
    opt = _optimizer(kind, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = (model(x[rows]) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference(kind, world):
    layers = _plain_layers()
    model = Model(nn.ModuleList(layers))
    losses = _train(model, layers, _batches(world), kind, slice(None))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(kind):
    bmt.init_distributed(seed=0)
    rank, world = bmt.rank(), bmt.world_size()
    plain = _plain_layers()
    blocks = [bmt.Block(layer) for layer in plain]
    model = Model(nn.ModuleList(blocks))

    out = blocks[0](torch.randn(3, DIM))
    assert isinstance(out, tuple) and len(out) == 1  # a list comes back as a tuple
    for layer in plain:
        layer.calls = 0

    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    # BMTrain's way to freeze a whole block: through its parameters
    losses = _train(model, blocks, _batches(world), kind, rows)
    frozen_out = blocks[0](torch.randn(3, DIM))[0]
    assert frozen_out.grad_fn is None and not frozen_out.requires_grad
    calls = [layer.calls for layer in plain]
    grads_none = [all(p.grad is None for p in b.parameters()) for b in blocks]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, calls, grads_none, state


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_blocks_built_with_bmtrains_defaults_train_as_plain_pytorch(world, kind):
    ref_losses, ref_state = _reference(kind, world)
    results = run_ranks(_ranks, world, kind)
    # each rank's loss is its slice's: their mean is the whole batch's
    mean_losses = [sum(r[0][step] for r in results) / world for step in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for _, calls, grads_none, state in results:
        # frozen blocks ran once a step (block 0 once more, for the grad_fn check),
        # training ones twice
        assert calls == [STEPS + 1] + [STEPS] * (FROZEN - 1) + [2 * STEPS] * (LAYERS - FROZEN)
        assert grads_none == [True] * FROZEN + [False] * (LAYERS - FROZEN)
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
