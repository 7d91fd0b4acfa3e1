"""Replicated parameters of a tensor-parallel model get plain PyTorch's gradient in both
layouts (nbtrain.zero.tp_partial): sequence parallel, where each tp rank sees its
slice of the tokens and the gradients are summed over tp, and Megatron's, where every
tp rank sees every token and they are averaged. Each owner is covered: a plain
nn.LayerNorm of a DistributedModule (data-parallel buckets), a DistributedParameter
outside Blocks, a Block's flat group, and nbtrain.nn.LayerNorm, which sums over tp
itself (so it must not be summed twice). At tp 2 and at tp 2 x dp 2, with SGD
momentum (a gradient scale error shows) against one plain process.
"""

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

D, FF, ROWS, STEPS = 6, 8, 8, 3


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, h):
        return self.ln(h) * self.gain


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)
        self.norm = nn.LayerNorm(D)
        self.shift = nn.Parameter(torch.randn(D) * 0.1)
        self.block = Inner()
        self.tpnorm = nn.LayerNorm(D)
        with torch.no_grad():  # not the default ones and zeros: every gradient matters
            for p in (
                self.norm.weight,
                self.norm.bias,
                self.tpnorm.weight,
                self.tpnorm.bias,
                self.block.ln.weight,
                self.block.ln.bias,
            ):
                p.add_(torch.randn(D) * 0.2)

    def forward(self, x):
        h = x + self.down(torch.tanh(self.up(x)))
        return self.tpnorm(self.block(self.norm(h) + self.shift))


def _data():
    g = torch.Generator().manual_seed(8)
    return (torch.randn(STEPS, ROWS, D, generator=g), torch.randn(STEPS, ROWS, D, generator=g))


def _train(model, rows_of, weight):
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    xs, gs = _data()
    for step in range(STEPS):
        opt.zero_grad()
        out = model(rows_of(xs[step]))
        (out * rows_of(gs[step])).sum().mul(weight).backward()
        opt.step()


def plain_state():
    model = Plain()
    _train(model, lambda t: t, 1.0 / ROWS)
    return model.state_dict()


def train_tp(sequence_parallel):
    import nbtrain as bmt
    from nbtrain.nn import ColumnParallelLinear, LayerNorm, RowParallelLinear

    topo = bmt.init_distributed(tp_size=2).topology
    plain = Plain()

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(D, FF, gather_input=sequence_parallel)
            self.down = RowParallelLinear(FF, D, all_reduce_output=not sequence_parallel)
            self.norm = nn.LayerNorm(D)
            self.shift = bmt.DistributedParameter(plain.shift.detach())
            self.block = bmt.Block(Inner())
            self.tpnorm = LayerNorm(D, sequence_parallel=sequence_parallel)

        forward = Plain.forward

    model = Model()
    model.load_state_dict(plain.state_dict())
    dp_rows = ROWS // topo.dp_size
    tp_rows = dp_rows // topo.tp_size

    def rows_of(t):  # this rank's rows: its dp slice, and its tp slice when sequence parallel
        t = t[topo.dp_rank * dp_rows : (topo.dp_rank + 1) * dp_rows]
        return t[topo.tp_rank * tp_rows : (topo.tp_rank + 1) * tp_rows] if sequence_parallel else t

    # The loss each rank computes: its rows' share of the plain mean over ROWS rows,
    # scaled so that the average over dp of the (tp-summed) gradients is the plain one.
    _train(model, rows_of, topo.dp_size / ROWS)
    partial = {
        "shift": model._parameters["shift"]._nbtrain_tp_layout.partial,
        "block": model.block.groups[0].tp_layout.partial,
    }
    return model.state_dict(), partial


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_gradients_in_both_tp_layouts_equal_plain_pytorch(world):
    want = plain_state()
    for sequence_parallel in (True, False):
        for rank, (state, partial) in enumerate(
            run_ranks(train_tp, world, sequence_parallel, timeout_s=180)
        ):
            assert list(state) == list(want)
            for key, value in want.items():
                torch.testing.assert_close(
                    state[key],
                    value,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"sp={sequence_parallel} rank {rank} {key}",
                )
            assert partial["shift"] == [sequence_parallel], partial
            assert partial["block"] == [sequence_parallel] * 3, partial  # ln.weight, ln.bias, gain
