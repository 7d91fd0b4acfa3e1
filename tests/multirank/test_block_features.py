"""Block details: frozen parameters, buffers, tuple outputs, keyword arguments,
BMTrain-style DistributedModule models and deferred initialisation."""

import math

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

import nbtrain as nbt


class Fancy(nn.Module):
    """Frozen weight, both kinds of buffer, keyword argument, tuple output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 5)
        self.frozen = nn.Parameter(torch.randn(5, 5), requires_grad=False)
        self.wide = nn.Linear(5, 3).to(torch.float64)
        self.register_buffer("scale", torch.full((5,), 0.5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x, *, shift=0.0):
        h = torch.tanh(self.lin(x) * self.scale + shift) @ self.frozen
        return h, self.wide(h.double()).sum(-1)


def _fancy_run(level, ckpt):
    torch.manual_seed(0)
    plain = Fancy()
    torch.manual_seed(0)
    block = nbt.Block(Fancy(), zero_level=level, use_checkpoint=ckpt)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(nbt.rank()))
    out_p = plain(x, shift=0.25)
    out_b = block(x, shift=0.25)
    (out_p[0].sum() + out_p[1].sum()).backward()
    (out_b[0].sum() + out_b[1].sum()).backward()
    grads = nbt.zero.full_named_grads(block)
    # DDP semantics: the block's grads are the mean over ranks of the plain grads.
    plain_grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    for g in plain_grads.values():
        torch.distributed.all_reduce(g)
        g /= nbt.world_size()
    return (
        [o.detach() for o in out_p],
        [o.detach() for o in out_b],
        plain_grads,
        grads,
        sorted(block.state_dict()),
        sorted(plain.state_dict()),
        [g.shard.dtype for g in block.groups],
        [g.requires_grad for g in block.groups],
    )


@pytest.mark.parametrize("level,ckpt", [(2, False), (3, False), (3, True)])
def test_frozen_buffers_tuples_kwargs(level, ckpt):
    for out_p, out_b, plain_grads, grads, keys_b, keys_p, dtypes, trainable in run_ranks(
        _fancy_run, 2, level, ckpt
    ):
        for a, b in zip(out_p, out_b):
            torch.testing.assert_close(a, b)
        assert (
            set(grads) == set(plain_grads) == {"lin.weight", "lin.bias", "wide.weight", "wide.bias"}
        )
        for name, g in plain_grads.items():
            torch.testing.assert_close(grads[name], g)
        assert keys_b == keys_p and "scratch" not in keys_b
        # one flat buffer per (dtype, requires_grad)
        assert sorted(zip(map(str, dtypes), trainable)) == [
            ("torch.float32", False),
            ("torch.float32", True),
            ("torch.float64", True),
        ]


class BMTLinear(nbt.DistributedModule):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.weight = nbt.DistributedParameter(
            torch.empty(dim_out, dim_in),
            init_method=nbt.ParameterInitializer(nn.init.kaiming_uniform_, a=math.sqrt(5)),
        )
        self.bias = nbt.DistributedParameter(
            torch.empty(dim_out), init_method=nbt.ParameterInitializer(nn.init.zeros_)
        )

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class BMTModel(nbt.DistributedModule):
    def __init__(self):
        super().__init__()
        self.emb = nbt.DistributedParameter(torch.empty(11, 6), init_method=nn.init.normal_)
        self.layers = nbt.TransformerBlockList(
            [nbt.Block(nn.Sequential(BMTLinear(6, 6), nn.GELU())) for _ in range(3)]
        )
        self.out = BMTLinear(6, 11)

    def forward(self, idx):
        return self.out(self.layers(self.emb[idx]))


def _bmt_state_and_loss():
    model = BMTModel()
    nbt.init_parameters(model)
    idx = torch.arange(8) % 11
    loss = nn.functional.cross_entropy(model(idx), idx)
    loss.backward()
    return model.state_dict(), loss.item(), nbt.zero.full_named_grads(model)


def test_deferred_init_is_world_size_independent():
    by_world = {w: run_ranks(_bmt_state_and_loss, w)[0] for w in (1, 2, 3)}
    state1, loss1, grads1 = by_world[1]
    assert set(state1) == {"emb", "out.weight", "out.bias"} | {
        f"layers.{i}.0.{p}" for i in range(3) for p in ("weight", "bias")
    }
    assert state1["out.bias"].abs().sum() == 0 and state1["emb"].std() > 0.5
    for world in (2, 3):
        state, loss, grads = by_world[world]
        for k, v in state1.items():
            torch.testing.assert_close(
                state[k], v, msg=lambda m, world=world, k=k: f"world {world} {k}: {m}"
            )
        assert loss == pytest.approx(loss1, abs=1e-6)
        for k, g in grads1.items():
            torch.testing.assert_close(grads[k], g, atol=1e-6, rtol=1e-5)
