"""BMTrain's names on real ranks: nbtrain.distributed's values and gradients against the
same maths on one process, send/recv_activations, gather_result, OpParallelLinear at
tp 2, and BMTrainModelWrapper training equal to the plain model.

Gradient conventions (BMTrain's, see nbtrain.distributed.ops): all_gather and
all_reduce give every rank the same result, from which every rank computes the same
loss, counted once; reduce_scatter and broadcast give each rank its own result and
the loss is the sum of the ranks' losses.
"""

import warnings

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

import nbtrain as nbt

WORLD = 2
OPS = ("sum", "avg", "max", "min", "prod")
f64 = torch.float64


def _rank_input(rank: int) -> torch.Tensor:
    """(3, 2), values distinct across ranks (no ties for max/min), none zero."""
    return torch.arange(1.0, 7.0, dtype=f64).view(3, 2) * (1.5 if rank else -1.0) + 0.25 * rank


def _rank_rows(rank: int) -> torch.Tensor:
    """(WORLD * 2, 2): the input of reduce_scatter."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(WORLD * 2, 2, dtype=f64, generator=g)


def _shared_weights() -> torch.Tensor:
    """(WORLD, 3, 2), the same on every rank: the loss weights."""
    return torch.linspace(-1.0, 2.0, WORLD * 6, dtype=f64).view(WORLD, 3, 2)


def _rank_weights(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(20 + rank)
    return torch.randn(shape, dtype=f64, generator=g)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def _op_parallel_linear(rank: int) -> dict:
    """The four layouts of a tp linear layer, at tp 2 (the whole world)."""
    nbt.init_distributed(tp_size=WORLD)
    apply = nbt.nn.OpParallelLinear.apply
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, dtype=f64, generator=g)  # tokens x in, column layers
    w = torch.randn(4, 3, dtype=f64, generator=g)  # (out, in) of a column layer
    b = torch.randn(4, dtype=f64, generator=g)
    x4 = torch.randn(4, 4, dtype=f64, generator=g)  # tokens x in, row layers
    w_row = torch.randn(2, 4, dtype=f64, generator=g)  # (out, in) of a row layer
    grad = torch.randn(4, 4, dtype=f64, generator=g)  # loss weights of (4, 4) outputs
    grad_row = torch.randn(4, 2, dtype=f64, generator=g)
    mine = slice(2 * rank, 2 * rank + 2)
    out = {}

    # Column-parallel, sequence parallel: token slice in, gathered columns out.
    xs, ws, bs = _leaf(x[mine]), _leaf(w[mine]), _leaf(b[mine])
    y = apply(xs, ws, bs, True, True, False, None)
    (y * grad).sum().backward()
    out["column_seq"] = (y.detach(), xs.grad, ws.grad, bs.grad)

    # Column-parallel, Megatron: whole input, this rank's columns out (its own loss).
    xs, ws, bs = _leaf(x), _leaf(w[mine]), _leaf(b[mine])
    y = apply(xs, ws, bs, False, False, False, None)
    (y * grad[:, mine]).sum().backward()
    out["column_megatron"] = (y.detach(), xs.grad, ws.grad, bs.grad)

    # Row-parallel, Megatron: whole input split here, outputs summed on every rank.
    xs, ws = _leaf(x4), _leaf(w_row[:, mine])
    y = apply(xs, ws, None, False, False, True, nbt.nn.ReduceType.ALL_REDUCE)
    (y * grad_row).sum().backward()
    out["row_megatron"] = (y.detach(), xs.grad, ws.grad)

    # Row-parallel, sequence parallel: input columns in, token slice of the sum out.
    xs, ws = _leaf(x4[:, mine]), _leaf(w_row[:, mine])
    y = apply(xs, ws, None, False, False, False, 2)
    (y * grad_row[mine]).sum().backward()
    out["row_seq"] = (y.detach(), xs.grad, ws.grad)
    out["inputs"] = (x, w, b, x4, w_row, grad, grad_row)
    return out


def _on_ranks() -> dict:
    D = nbt.distributed
    rank = nbt.rank()
    x, shared = _rank_input(rank), _shared_weights()
    out = {}

    xg = _leaf(x)
    y = D.all_gather(xg)
    (y * shared).sum().backward()
    out["all_gather"] = (y.detach(), xg.grad)

    for op in OPS:
        xr = _leaf(x)
        y = D.all_reduce(xr, op)
        (y * shared[0]).sum().backward()
        out[f"all_reduce_{op}"] = (y.detach(), xr.grad)

    for op in ("sum", "avg"):
        xs = _leaf(_rank_rows(rank))
        y = D.reduce_scatter(xs, op)
        (y * _rank_weights(rank, y.shape)).sum().backward()
        out[f"reduce_scatter_{op}"] = (y.detach(), xs.grad)
    xs = _leaf(_rank_rows(rank))
    y = D.reduce_scatter(xs, "max")
    out["reduce_scatter_max"] = y.detach()
    try:
        y.sum().backward()
        out["reduce_scatter_max_grad"] = "no error"
    except NotImplementedError as err:
        out["reduce_scatter_max_grad"] = str(err)

    ints = torch.tensor([[3], [4]]) + 3 * rank  # sums 9 and 11: the average truncates
    out["int_avg"] = (D.all_reduce(ints, "avg"), D.reduce_scatter(ints, "avg"))

    xb = _leaf(x)
    y = D.broadcast(xb, 1)
    (y * _rank_weights(rank, y.shape)).sum().backward()
    out["broadcast"] = (y.detach(), xb.grad)

    # Point to point: a copy is sent, so changing the tensor at once changes nothing.
    sent = torch.arange(6.0).view(2, 3)
    if rank == 0:
        D.send_activations(sent, 1)
        sent.add_(100)
        D.send_activations(torch.tensor([7, 8, 9]), 1)
        out["received"] = [D.recv_activations(1)]
    else:
        out["received"] = [D.recv_activations(0), D.recv_activations(0)]
        D.send_activations(torch.ones(2, 2, 1, dtype=torch.bfloat16) * 3, 0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["gather_result"] = nbt.gather_result(torch.full((2, 3), float(rank)))
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    out["alone"] = None  # filled at tp 2, where the dp group is this rank alone

    out["parallel_linear"] = _op_parallel_linear(rank)
    out["alone"] = D.all_gather(x, comm="dp").shape
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_ranks, WORLD, timeout_s=240)


def _stacked() -> torch.Tensor:
    return torch.stack([_rank_input(r) for r in range(WORLD)])


def test_all_gather_values_and_gradients(ranks):
    X, shared = _leaf(_stacked()), _shared_weights()
    (X * shared).sum().backward()  # the same loss on every rank, counted once
    for rank, got in enumerate(ranks):
        y, grad = got["all_gather"]
        torch.testing.assert_close(y, X.detach())
        torch.testing.assert_close(grad, X.grad[rank])


@pytest.mark.parametrize("op", OPS)
def test_all_reduce_values_and_gradients(ranks, op):
    reduce = {
        "sum": lambda t: t.sum(0),
        "avg": lambda t: t.mean(0),
        "max": lambda t: t.amax(0),
        "min": lambda t: t.amin(0),
        "prod": lambda t: t.prod(0),
    }[op]
    X = _leaf(_stacked())
    want = reduce(X)
    (want * _shared_weights()[0]).sum().backward()
    for rank, got in enumerate(ranks):
        y, grad = got[f"all_reduce_{op}"]
        torch.testing.assert_close(y, want.detach())
        torch.testing.assert_close(grad, X.grad[rank])


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_values_and_gradients(ranks, op):
    X = _leaf(torch.stack([_rank_rows(r) for r in range(WORLD)]))
    total = X.sum(0) if op == "sum" else X.mean(0)
    rows = total.shape[0] // WORLD
    parts = [total[r * rows : (r + 1) * rows] for r in range(WORLD)]
    sum((p * _rank_weights(r, p.shape)).sum() for r, p in enumerate(parts)).backward()
    for rank, got in enumerate(ranks):
        y, grad = got[f"reduce_scatter_{op}"]
        torch.testing.assert_close(y, parts[rank].detach())
        torch.testing.assert_close(grad, X.grad[rank])


def test_reduce_scatter_max_has_values_but_no_gradient(ranks):
    X = torch.stack([_rank_rows(r) for r in range(WORLD)]).amax(0)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["reduce_scatter_max"], X[2 * rank : 2 * rank + 2])
        assert "reduce_scatter(op='max') has no gradient" in got["reduce_scatter_max_grad"]


def test_an_integer_average_truncates(ranks):
    for rank, got in enumerate(ranks):
        reduced, scattered = got["int_avg"]
        assert reduced.dtype == scattered.dtype == torch.int64
        assert reduced.tolist() == [[4], [5]] and scattered.tolist() == [[4 + rank]]


def test_broadcast_values_and_gradients(ranks):
    X = _leaf(_stacked())
    outs = [X[1] for _ in range(WORLD)]  # root 1's tensor on every rank
    sum((o * _rank_weights(r, o.shape)).sum() for r, o in enumerate(outs)).backward()
    for got in ranks:
        y, grad = got["broadcast"]
        torch.testing.assert_close(y, X[1].detach())
        # The root's gradient is the sum of every rank's; BMTrain gives every rank
        # that sum (the maths gives the other ranks zero).
        torch.testing.assert_close(grad, X.grad[1])
    assert torch.count_nonzero(X.grad[0]) == 0


def test_send_and_recv_activations(ranks):
    first, second = ranks[1]["received"]
    assert first.dtype == torch.float32 and torch.equal(first, torch.arange(6.0).view(2, 3))
    assert second.dtype == torch.int64 and torch.equal(second, torch.tensor([7, 8, 9]))
    (back,) = ranks[0]["received"]
    assert back.dtype == torch.bfloat16 and back.shape == (2, 2, 1)
    assert torch.equal(back, torch.full((2, 2, 1), 3.0, dtype=torch.bfloat16))


def test_gather_result(ranks):
    want = torch.tensor([0.0, 0.0, 1.0, 1.0]).view(4, 1).expand(4, 3)
    for got in ranks:
        assert torch.equal(got["gather_result"], want)
        ((category, message),) = got["warnings"]
        assert category == "DeprecationWarning" and "distributed.all_gather" in message
        assert got["alone"] == (1, 3, 2)


def test_op_parallel_linear_at_tp_two(ranks):
    x, w, b, x4, w_row, grad, grad_row = ranks[0]["parallel_linear"]["inputs"]
    xc, wc, bc = _leaf(x), _leaf(w), _leaf(b)
    col = xc @ wc.T + bc
    (col * grad).sum().backward()
    xr, wr = _leaf(x4), _leaf(w_row)
    row = xr @ wr.T
    (row * grad_row).sum().backward()
    for rank, got in enumerate(ranks):
        mine = slice(2 * rank, 2 * rank + 2)
        res = got["parallel_linear"]
        checks = {
            "column_seq": (col, xc.grad[mine], wc.grad[mine], bc.grad[mine]),
            "column_megatron": (col[:, mine], xc.grad, wc.grad[mine], bc.grad[mine]),
            "row_megatron": (row, xr.grad, wr.grad[:, mine]),
            "row_seq": (row[mine], xr.grad[:, mine], wr.grad[:, mine]),
        }
        for name, want in checks.items():
            for i, (g, w_) in enumerate(zip(res[name], want)):
                torch.testing.assert_close(g, w_.detach(), msg=f"{name}[{i}] rank {rank}")


# -- BMTrainModelWrapper ----------------------------------------------------------------


class ListNet(nn.Module):
    """Layers in a ModuleList (Blocks), a list with a parameter-free entry, loose
    parameters around them and a buffer. Sizes no world size of 2 divides."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(7, 7), nn.GELU()) for _ in range(3)])
        self.mixed = nn.ModuleList([nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7)])
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h) * self.scale
        for layer in self.mixed:
            h = layer(h)
        return self.head(self.norm(h))


STEPS, BATCH = 3, 4  # per rank


def _plain() -> ListNet:
    torch.manual_seed(0)
    return ListNet().to(f64)


def _data():
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(STEPS, WORLD * BATCH, 5, dtype=f64, generator=g),
        torch.randn(STEPS, WORLD * BATCH, 3, dtype=f64, generator=g),
    )


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


def _train(model, make_opt, rows=slice(None)):
    opt = make_opt(model.parameters())
    xs, ys = _data()
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs[s, rows]), ys[s, rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _wrapped_training():
    rank = nbt.rank()
    out = {}
    for name, make_opt in OPTIMIZERS.items():
        model = nbt.BMTrainModelWrapper(_plain())
        out["structure"] = (
            [type(m).__name__ for m in model.layers],
            [type(m).__name__ for m in model.mixed],
        )
        losses = _train(model, make_opt, slice(rank * BATCH, (rank + 1) * BATCH))
        out[name] = (losses, model.state_dict())
    return out


@pytest.fixture(scope="module")
def wrapped():
    return run_ranks(_wrapped_training, WORLD, timeout_s=240)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bmtrain_model_wrapper_trains_like_the_plain_model(wrapped, name):
    plain = _plain()
    want_losses = _train(plain, OPTIMIZERS[name])
    want = plain.state_dict()
    per_rank = [got[name][0] for got in wrapped]
    # Each rank's loss is the mean over its rows: their mean is the whole batch's.
    torch.testing.assert_close(torch.tensor(per_rank).mean(0), torch.tensor(want_losses))
    for got in wrapped:
        layers, mixed = got["structure"]
        assert layers == ["Block"] * 3 and mixed == ["Block", "Tanh", "Block"]
        state = got[name][1]
        assert list(state) == list(want)
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, msg=key)
