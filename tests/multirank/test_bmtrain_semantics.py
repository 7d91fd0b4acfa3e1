"""BMTrain's semantics where a BMTrain script relies on them, against plain PyTorch.

The model is written as a BMTrain user writes one: `DistributedModule`s holding
`DistributedParameter`s, Blocks in a `TransformerBlockList`, Blocks around modules
without parameters (an activation, a dropout, a scaling residual), one Block at
ZeRO-2 and one recomputing its activations. The same classes built with
`nn.Module`/`nn.Parameter` and no Blocks are the single-process reference, trained
on the whole batch while each rank trains on its slice.

Checked at every step, with SGD (momentum), AdamW, and BMTrain's AdamOffloadOptimizer
in an OptimManager (against torch's Adam: L2 weight decay for fp32, as BMTrain's):
  * the losses, and at the end every weight, equal the reference's;
  * `.grad` of every DistributedParameter holds this rank's part of the reference's
    gradient: in a Block, the part `_start_partition:_end_partition` of the
    flattened gradient (BMTrain's layout); outside Blocks, the parameter's shard;
  * `requires_grad_(False)` between steps freezes, and `requires_grad_(True)`
    thaws: through `named_parameters()` (the usual way) and through the
    DistributedParameter objects themselves; a frozen parameter is not updated and
    its `.grad` is None, as in plain PyTorch.
"""

import pytest
import torch
import torch.nn.functional as F
from support.ranks import run_ranks
from torch import nn

import nbtrain as bmt
from nbtrain.zero.partition import shard_range

VOCAB, DIM, BATCH_PER_RANK, SEQ, STEPS = 11, 6, 2, 5, 6
FROZEN_STEPS = (2, 3)  # layers.0, layers.4, the final norm and the head frozen here


def _param(shape, dist):
    data = torch.randn(*shape) * 0.3
    return bmt.DistributedParameter(data) if dist else nn.Parameter(data)


def _base(dist):
    return bmt.DistributedModule if dist else nn.Module


def build(dist: bool):
    """The model, BMTrain style when `dist`, plain otherwise; same values either way."""
    Base = _base(dist)

    class Linear(Base):
        def __init__(self, i, o):
            super().__init__()
            self.weight = _param((o, i), dist)
            self.bias = _param((o,), dist)

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    class Layer(Base):
        def __init__(self):
            super().__init__()
            self.fc_in, self.fc_out = Linear(DIM, 2 * DIM), Linear(2 * DIM, DIM)

        def forward(self, x):
            return x + self.fc_out(torch.tanh(self.fc_in(x)))

    class HalfResidual(nn.Module):  # no parameters
        def forward(self, x):
            return x + 0.5 * x.roll(1, dims=-1)

    class Model(Base):
        def __init__(self):
            super().__init__()
            self.embed = _param((VOCAB, DIM), dist)
            layers = [
                Layer(),
                nn.GELU(),
                Layer(),
                nn.Sequential(nn.Dropout(0.0), HalfResidual()),
                Layer(),
            ]
            if dist:
                layers = bmt.TransformerBlockList(
                    [
                        bmt.Block(layers[0]),
                        bmt.Block(layers[1]),
                        bmt.Block(layers[2], zero_level=2),
                        bmt.Block(layers[3]),
                        bmt.Block(layers[4], use_checkpoint=True),
                    ]
                )
            self.layers = layers if dist else nn.ModuleList(layers)
            self.norm = nn.LayerNorm(DIM)  # a plain parameter: data parallel
            self.head = Linear(DIM, VOCAB)

        def forward(self, ids):
            h = F.embedding(ids, self.embed)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Model()


def batches(world):
    g = torch.Generator().manual_seed(5)
    shape = (STEPS, world * BATCH_PER_RANK, SEQ)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def make_optimizer(kind, params, dist=False):
    """ "sgd", "adamw", or "bmt": BMTrain's AdamOffloadOptimizer in an OptimManager on
    the sharded model (the plain model: torch's Adam, the same update: BMTrain's weight
    decay of fp32 parameters is L2)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    if kind == "bmt" and dist:
        manager = bmt.optim.OptimManager(loss_scale=None)
        manager.add_optimizer(bmt.optim.AdamOffloadOptimizer(params, lr=0.02, weight_decay=0.1))
        return manager
    if kind == "bmt":
        return torch.optim.Adam(params, lr=0.02, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)


def _frozen(name):
    return name.startswith(("layers.0.", "layers.4.", "norm.", "head."))


def train_plain(kind, world):
    model = build(dist=False)
    opt = make_optimizer(kind, model.parameters())
    xs, ys = batches(world)
    losses, grads = [], []
    for step in range(STEPS):
        for name, p in model.named_parameters():
            p.requires_grad_(not (step in FROZEN_STEPS and _frozen(name)))
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[step]).flatten(0, 1), ys[step].flatten())
        loss.backward()
        grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
        opt.step()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


def _distributed_parameters(model):
    """name -> DistributedParameter, taken while building (a Block keeps the objects)."""
    out = {}
    for mod_name, mod in model.named_modules():
        for pname, value in vars(mod).items():
            if isinstance(value, bmt.DistributedParameter):
                out[f"{mod_name}.{pname}"] = value
        for pname, value in mod._parameters.items():
            if isinstance(value, bmt.DistributedParameter):
                out[f"{mod_name}.{pname}" if mod_name else pname] = value
    return out


def train_bmtrain(kind):
    rank, world = bmt.rank(), bmt.world_size()
    model = build(dist=True)
    members = _distributed_parameters(model)
    opt = make_optimizer(kind, model.parameters(), dist=True)
    xs, ys = batches(world)
    lo, hi = rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK
    losses, grads = [], []
    for step in range(STEPS):
        frozen = step in FROZEN_STEPS
        # The usual way: by name. In nbtrain a Block's names are its flat shards'.
        for name, p in model.named_parameters():
            if _frozen(name) and not name.startswith("layers.4."):
                p.requires_grad_(not frozen)
        # And through the DistributedParameter objects a Block holds.
        for name, p in members.items():
            if name.startswith("layers.4."):
                p.requires_grad_(not frozen)
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[step, lo:hi]).flatten(0, 1), ys[step, lo:hi].flatten())
        opt.backward(loss) if kind == "bmt" else loss.backward()
        grads.append(
            {
                n: (
                    None if p.grad is None else p.grad.clone(),
                    getattr(p, "_start_partition", False),
                    getattr(p, "_end_partition", 0),
                )
                for n, p in members.items()
            }
        )
        opt.step()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


def _expected_part(full_grad, start, end):
    """A Block's parameter's part of a reference gradient (None: no part here)."""
    flat = full_grad.reshape(-1)
    return flat[:0] if start is None else flat[start:end]


@pytest.mark.parametrize("kind", ["sgd", "adamw", "bmt"])
def test_a_bmtrain_model_with_grads_and_freezing_matches_plain_pytorch(kind):
    world = 2
    want_losses, want_grads, want_state = train_plain(kind, world)
    results = run_ranks(train_bmtrain, world, kind, timeout_s=240)
    mean_losses = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(mean_losses, want_losses, rtol=1e-5, atol=1e-6)
    for rank, (_, grads, state) in enumerate(results):
        assert list(state) == list(want_state)
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
        for step, (got, want) in enumerate(zip(grads, want_grads)):
            plain_ones = {"norm.weight", "norm.bias"}  # not DistributedParameters
            assert set(got) == set(want) - plain_ones, "every DistributedParameter is found"
            for name, (grad, start, end) in got.items():
                if want[name] is None:
                    assert grad is None, f"step {step}: frozen {name} has a gradient"
                    continue
                assert grad is not None, f"step {step}: {name}.grad is None after backward"
                if start is False:  # outside Blocks: the parameter's own shard
                    numel = want[name].numel()
                    b, e = shard_range(numel, world, rank)
                    expect = want[name].reshape(-1)[b : min(e, numel)]
                    got_part = grad[: expect.numel()]
                else:
                    expect, got_part = _expected_part(want[name], start, end), grad
                torch.testing.assert_close(
                    got_part, expect, rtol=1e-4, atol=1e-6, msg=f"step {step} rank {rank} {name}"
                )
    # Each rank holds some part of the blocks' parameters, together all of them.
    for name in results[0][1][0]:
        _, start, end = results[0][1][0][name]
        if start is False:
            continue
        covered = sum(
            r[1][0][name][2] - (r[1][0][name][1] or 0)
            for r in results
            if r[1][0][name][1] is not None
        )
        assert covered == want_grads[0][name].numel(), name


def _mixed_toggle():
    """One parameter of a flat buffer frozen: it alone gets no gradient (the rest of the
    buffer trains; parity with plain PyTorch: test_freeze_in_block.py)."""
    model = build(dist=True)
    members = _distributed_parameters(model)
    members["layers.0.fc_in.weight"].requires_grad_(False)
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    model(ids).sum().backward()
    return (
        members["layers.0.fc_in.weight"].grad is None,
        members["layers.0.fc_in.bias"].grad is not None,
        members["layers.0.fc_out.weight"].grad is not None,
    )


def _block_views():
    """Outside forward a Block's module shows the DistributedParameter (this rank's
    part); inside forward, the full tensor; `gather` of a held one is refused."""
    seen = {}
    layer = build(dist=True).layers[0]
    linear = layer.fc_in
    seen["rest"] = (type(linear.weight).__name__, tuple(linear.weight.shape))
    original = linear.forward

    def spy(x):
        seen["inside"] = tuple(linear.weight.shape)
        return original(x)

    linear.forward = spy
    layer(torch.zeros(1, 1, DIM))
    seen["after"] = type(linear.weight).__name__
    try:
        linear.weight.gather()
    except RuntimeError as err:
        seen["gather"] = str(err)
    return seen


def test_freezing_one_parameter_of_a_blocks_buffer_freezes_it_alone_and_the_views_are_bmtrains():
    assert run_ranks(_mixed_toggle, 1, timeout_s=120)[0] == (True, True, True)
    seen = run_ranks(_block_views, 2, timeout_s=120)[0]
    assert seen["rest"][0] == "DistributedParameter" and len(seen["rest"][1]) == 1
    assert seen["inside"] == (2 * DIM, DIM)
    assert seen["after"] == "DistributedParameter"
    assert "held by a Block" in seen["gather"]


def _parameter_free_blocks(folder):
    x = torch.randn(2, 3, 4, requires_grad=True)
    blocks = bmt.TransformerBlockList(
        [bmt.Block(nn.GELU()), bmt.Block(nn.Dropout(0.0)), bmt.Block(nn.Linear(4, 4))]
    )
    torch.manual_seed(1)
    plain = nn.Linear(4, 4)
    blocks.load_state_dict({"2.weight": plain.weight, "2.bias": plain.bias})
    out = blocks(x)
    out.sum().backward()
    y = x.detach().clone().requires_grad_(True)
    ref = plain(F.gelu(y))
    ref.sum().backward()
    path = f"{folder}/blocks.safetensors"  # the checkpoint path skips the empty blocks
    bmt.save(blocks, path)
    with torch.no_grad():
        blocks[2].flat_param_0.zero_()
    bmt.load(blocks, path)
    reloaded = torch.equal(blocks.state_dict()["2.weight"], plain.weight.detach())
    return (
        torch.allclose(out, ref, atol=1e-6) and reloaded,
        torch.allclose(x.grad, y.grad, atol=1e-6),
        list(bmt.Block(nn.ReLU()).state_dict()),
        len(list(bmt.Block(nn.ReLU()).parameters())),
    )


def test_blocks_around_modules_without_parameters_run_them(tmp_path):
    same_out, same_grad, keys, nparams = run_ranks(
        _parameter_free_blocks, 2, str(tmp_path), timeout_s=120
    )[0]
    assert same_out and same_grad
    assert keys == [] and nparams == 0


class _TwoStates(nn.Module):
    """Two hidden states in, two out, and an argument every block gets."""

    def __init__(self, k):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), float(k)))

    def forward(self, h, aux, mask):
        return torch.tanh(h * self.w + mask), aux + h.sum(-1)


def _blocklist_hidden_states():
    torch.manual_seed(0)
    plain = [_TwoStates(k) for k in (1, 2, 3)]
    blocks = bmt.TransformerBlockList([bmt.Block(_TwoStates(k)) for k in (1, 2, 3)], num_hidden=2)
    h, aux, mask = torch.randn(2, 4), torch.zeros(2), torch.ones(4) * 0.1
    want_in, (x, a) = [], (h, aux)
    for layer in plain:
        want_in.append((x, a))
        x, a = layer(x, a, mask)
    out = blocks(h, aux, mask)
    full = blocks(h, aux, mask, return_hidden_states=True)
    single = bmt.TransformerBlockList([bmt.Block(nn.Linear(4, 4)), bmt.Block(nn.Tanh())])
    return (
        len(out) == 2 and torch.allclose(out[0], x) and torch.allclose(out[1], a),
        len(full) == 4
        and torch.allclose(full[2], torch.stack([w[0] for w in want_in]))
        and torch.allclose(full[3], torch.stack([w[1] for w in want_in])),
        isinstance(single(h), torch.Tensor),
    )


def test_transformer_block_list_passes_hidden_states_as_bmtrains():
    outputs, hidden_states, single = run_ranks(_blocklist_hidden_states, 1, timeout_s=120)[0]
    assert outputs, "the last block's num_hidden outputs"
    assert hidden_states, "each hidden state's inputs to the blocks, stacked"
    assert single, "one hidden state: a tensor, not a tuple"


def _one_layer_twice(kind):
    """A plain module listed twice in a TransformerBlockList is one layer used twice
    (BMTrain's): both uses' gradients add into the same shards, and training equals a
    plain model applying the layer twice. A Block listed twice, and a Block not built
    with mode="PIPE" in a PipelineTransformerBlockList, are AssertionErrors."""
    torch.manual_seed(0)
    layer, plain = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
    plain.load_state_dict(layer.state_dict())
    blocks = bmt.TransformerBlockList([layer, layer])
    distinct = blocks[0] is not blocks[1] and len(list(blocks.parameters())) == 1  # one shard
    opts = [make_optimizer(kind, m.parameters()) for m in (blocks, plain)]
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(bmt.world_size() * BATCH_PER_RANK, DIM, generator=g)
        mine = x.chunk(bmt.world_size())[bmt.rank()]
        pair = [(torch.tanh(blocks(mine)) ** 2).mean(), (torch.tanh(plain(plain(x))) ** 2).mean()]
        for loss, opt in zip(pair, opts):
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append((pair[0].item(), pair[1].item()))
    state = {k: v.clone() for k, v in blocks.state_dict().items()}
    refused = []
    block = bmt.Block(nn.Linear(DIM, DIM))
    for build_list in (
        lambda: bmt.TransformerBlockList([block, block]),
        lambda: bmt.PipelineTransformerBlockList([bmt.Block(nn.Linear(DIM, DIM))]),
    ):
        try:
            build_list()
        except AssertionError as err:
            refused.append(str(err))
    return distinct, losses, state, plain.state_dict(), refused


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_module_listed_twice_is_one_layer_used_twice_and_a_block_twice_is_refused(kind, world):
    results = run_ranks(_one_layer_twice, world, kind, timeout_s=120)
    for step in range(3):  # each rank's loss is its slice's: their mean is the batch's
        mean = sum(r[1][step][0] for r in results) / world
        assert mean == pytest.approx(results[0][1][step][1], rel=1e-5), (kind, world, step)
    for distinct, _, state, ref, refused in results:
        assert distinct
        for key in ("0.weight", "1.weight", "0.bias", "1.bias"):
            torch.testing.assert_close(state[key], ref[key.split(".", 1)[1]], rtol=1e-4, atol=1e-6)
        assert len(refused) == 2 and "listed twice" in refused[0] and 'mode="PIPE"' in refused[1]
