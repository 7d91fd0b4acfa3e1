"""`bmt.store._save_to_rank0(model, destination, prefix)`: rank 0 gets the full state
dict, equal to the plain model's, at world 1, 2 and 3; the other ranks get what they
passed. The model is one a BMTrain-based model library writes: its `state_dict()` is
`_save_to_rank0(self, destination, prefix)`, around DistributedParameters, Blocks in a
TransformerBlockList and a tied head. Checked after training steps with SGD (momentum)
and AdamW, so the gathered values are the trained ones, against one plain process on
the whole batch.
"""

import pytest
import torch
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

VOCAB, DIM, LAYERS, ROWS_PER_RANK, STEPS = 13, 7, 3, 2, 2


def build(dist: bool):
    import nbtrain as bmt

    Base = bmt.DistributedModule if dist else nn.Module

    def param(*shape):
        data = torch.randn(*shape) * 0.3
        return bmt.DistributedParameter(data) if dist else nn.Parameter(data)

    class Layer(Base):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = param(DIM, DIM), param(DIM)
            self.register_buffer("scale", torch.full((DIM,), 0.5))

        def forward(self, x):
            return x + torch.tanh(F.linear(x, self.weight, self.bias)) * self.scale

    class Model(Base):
        def __init__(self):
            super().__init__()
            self.emb = param(VOCAB, DIM)
            layers = [Layer() for _ in range(LAYERS)]
            self.layers = bmt.TransformerBlockList(layers) if dist else nn.ModuleList(layers)
            self.norm = nn.LayerNorm(DIM)

        def forward(self, ids):
            h = F.embedding(ids, self.emb)
            if dist:
                h = self.layers(h)
            else:
                for layer in self.layers:
                    h = layer(h)
            return F.linear(self.norm(h), self.emb)  # the head tied to the embedding

        if dist:

            def state_dict(self, destination=None, prefix="", keep_vars=False):
                return bmt.store._save_to_rank0(self, destination, prefix)

    torch.manual_seed(0)
    return Model()


def _train(model, ids, optimizer: str):
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(1, dims=1).flatten()).backward()
        opt.step()


def _batch(world):
    return torch.randint(
        0, VOCAB, (ROWS_PER_RANK * world, 5), generator=torch.Generator().manual_seed(1)
    )


def _ranks(optimizer: str):
    import nbtrain as bmt

    world, rank = bmt.world_size(), bmt.rank()
    model = build(dist=True)
    ids = _batch(world)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    _train(model, ids, optimizer)
    full = model.state_dict()  # the library's override: _save_to_rank0
    given = {"kept": torch.ones(1)}
    passed = bmt.store._save_to_rank0(model, given, "model.")
    return {
        "full": {k: v.clone() for k, v in full.items()},
        "prefixed": sorted(passed),
        "passed_is_given": passed is given,
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank0_gets_the_plain_models_full_state_dict(world, optimizer):
    out = run_ranks(_ranks, world, optimizer, timeout_s=240)
    plain = build(dist=False)
    _train(plain, _batch(world), optimizer)
    expected = plain.state_dict()
    got = out[0]["full"]
    assert list(got) == list(expected)  # the plain model's keys, in its order
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert out[0]["prefixed"] == sorted(["kept"] + [f"model.{k}" for k in expected])
    for other in out[1:]:  # the other ranks keep what they passed
        assert other["full"] == {}
        assert other["prefixed"] == ["kept"] and other["passed_is_given"]
