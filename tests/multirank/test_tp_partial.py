"""Replicated parameters of a tensor-parallel model get plain PyTorch's gradient in both
layouts (nbtrain.tensor_parallel.partial): sequence parallel, where each tp rank sees its
slice of the tokens and the gradients are summed over tp, and Megatron's, where every
tp rank sees every token and they are averaged. Each owner is covered: a plain
nn.LayerNorm of a DistributedModule (data-parallel buckets), a DistributedParameter
outside Blocks, a Block's flat group, and nbtrain.nn.LayerNorm, which sums over tp
itself (so it must not be summed twice). At tp 2 and at tp 2 x dp 2, with SGD
momentum (a gradient scale error shows) against one plain process. Each layout is
declared (`declare_tp_gradients`) or not, when it is the layout the model's tp layers
make; the gradients never decide it, they only check it.
"""

import pytest
import torch
from support.ranks import run_ranks
from torch import nn

from nbtrain.zero import placement_of

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


def train_tp(sequence_parallel, declared=False):
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
    if declared:  # the layout said; else the one the tp layers' flags make
        bmt.declare_tp_gradients(model, partial=sequence_parallel)
    dp_rows = ROWS // topo.dp_size
    tp_rows = dp_rows // topo.tp_size

    def rows_of(t):  # this rank's rows: its dp slice, and its tp slice when sequence parallel
        t = t[topo.dp_rank * dp_rows : (topo.dp_rank + 1) * dp_rows]
        return t[topo.tp_rank * tp_rows : (topo.tp_rank + 1) * tp_rows] if sequence_parallel else t

    # The loss each rank computes: its rows' share of the plain mean over ROWS rows,
    # scaled so that the average over dp of the (tp-summed) gradients is the plain one.
    _train(model, rows_of, topo.dp_size / ROWS)
    partial = {
        "shift": placement_of(model._parameters["shift"]).tp_layout.partial,
        "block": model.block.groups[0].tp_layout.partial,
    }
    return model.state_dict(), partial


@pytest.mark.parametrize("world,declared", [(2, False), (4, False), (2, True), (4, True)])
def test_replicated_gradients_in_both_tp_layouts_equal_plain_pytorch(world, declared):
    """Declared (`declare_tp_gradients`) or not (a BMTrain script: the layout its tp
    layers make), the same gradients as one plain process."""
    want = plain_state()
    for sequence_parallel in (True, False):
        for rank, (state, partial) in enumerate(
            run_ranks(train_tp, world, sequence_parallel, declared, timeout_s=180)
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


def rank_dependent(layout):
    """A replicated region whose op depends on the tp rank, in a model whose layout is
    declared ("whole": Megatron's; "partial": sequence parallel, though every tp rank
    sees every token here) or not ("undeclared": Megatron's layers, so whole). Returns
    the error each rank raised, or None."""
    import nbtrain as bmt
    from nbtrain.nn import ColumnParallelLinear, RowParallelLinear

    topo = bmt.init_distributed(tp_size=2).topology

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(D, FF, gather_input=False)
            self.down = RowParallelLinear(FF, D, all_reduce_output=True)
            self.shift = nn.Parameter(torch.zeros(D))
            self.block = bmt.Block(Inner())

        def forward(self, x):
            h = x + self.down(torch.tanh(self.up(x)))
            if layout != "partial":  # the bug: this rank's own arithmetic
                h = h * (1.0 + topo.tp_rank)
            return self.block(h + self.shift)

    torch.manual_seed(0)
    model = Model()
    if layout != "undeclared":
        bmt.declare_tp_gradients(model, partial=layout == "partial")
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))
    try:
        model(x).square().sum().backward()
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("layout", ["whole", "partial", "undeclared"])
def test_a_gradient_that_contradicts_its_layout_is_caught_not_summed(layout):
    """Read from the gradients, a rank-dependent op made a replicated gradient look
    partial, and it was summed over tp: silently tp times too large. Declared or not,
    the layout is known before the gradients arrive, and they only check it."""
    errors = run_ranks(rank_dependent, 2, layout, timeout_s=120)
    for err in errors:
        assert err is not None, errors
        if layout == "whole":
            assert "differs between the tp ranks, but it is whole over tp as declared" in err
        elif layout == "undeclared":  # the row-parallel bias, declared by its layer
            assert "differs between the tp ranks, but it is whole over tp" in err, err
        else:
            assert "the same on every tp rank, but it is partial over tp as declared" in err
        assert "nbtrain.declare_tp_gradients(" in err, err


class HandSplit(nn.Module):
    """Each tp rank takes its own tokens by hand; no tensor-parallel layer is built, so
    nothing in the model says the tokens are split."""

    def __init__(self, tp=1, rank=0):
        super().__init__()
        torch.manual_seed(0)
        self.shift = nn.Parameter(torch.randn(D) * 0.1)
        self.proj = nn.Linear(D, D)
        self.tp, self.rank = tp, rank

    def forward(self, x):
        return self.proj(x.chunk(self.tp)[self.rank] + self.shift).square().sum()


def split_tokens_by_hand(declare):
    """Undeclared, its partial gradients are caught (the default is whole: no layer
    splits the tokens); declared partial, they are summed over tp."""
    import nbtrain as bmt

    topo = bmt.init_distributed(tp_size=2).topology

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.inner = HandSplit(topo.tp_size, topo.tp_rank)

        def forward(self, x):
            return self.inner(x)

    model = Model()
    if declare:
        bmt.declare_tp_gradients(model, partial=True)
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))
    try:
        model(x).backward()
    except ValueError as err:
        return str(err)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_undeclared_gradients_take_the_layers_layout_and_a_declaration_overrides_it():
    errors = run_ranks(split_tokens_by_hand, 2, False, timeout_s=120)
    for err in errors:
        assert isinstance(err, str), errors
        assert "whole over tp by default, as no tensor-parallel layer hands on token" in err
        assert "declare_tp_gradients(model, partial=True)" in err, err
    plain = HandSplit()
    plain(torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))).backward()
    for grads in run_ranks(split_tokens_by_hand, 2, True, timeout_s=120):
        for name, param in plain.named_parameters():
            torch.testing.assert_close(grads[f"inner.{name}"], param.grad, msg=name)


def overflow_then_finite():
    """Declared partial (each tp rank takes its own tokens), a first backward whose
    shift gradient overflows to +Inf on every rank (a step a loss scaler skips; read as
    "the same on every tp rank" it would contradict the declaration), then a finite
    one: the check waits for the finite pass. Returns the shift's gradient."""
    import nbtrain as bmt

    topo = bmt.init_distributed(tp_size=2).topology

    class Model(bmt.DistributedModule):
        def __init__(self):
            super().__init__()
            self.inner = HandSplit(topo.tp_size, topo.tp_rank)

        def forward(self, x, overflow=False):
            # fp32 overflows past 3.4e38: the shift's gradient is +Inf on every rank
            return self.inner(x) + (1e39 * self.inner.shift.sum() if overflow else 0.0)

    model = Model()
    bmt.declare_tp_gradients(model, partial=True)
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))
    model(x, overflow=True).backward()
    assert torch.isinf(model.inner.shift.grad).all()
    model.zero_grad()
    model(x).backward()
    return model.inner.shift.grad.clone()


def test_an_overflowing_step_is_not_judged_the_next_finite_one_is():
    plain = HandSplit()
    plain(torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1))).backward()
    for grad in run_ranks(overflow_then_finite, 2, timeout_s=120):
        torch.testing.assert_close(grad, plain.shift.grad)


def _default_layouts():
    """The default layout as layers come and go, change their flags, and are copied."""
    import copy
    import gc

    import nbtrain as bmt
    from nbtrain.nn import ColumnParallelLinear, RowParallelLinear
    from nbtrain.tensor_parallel.partial import default_layout

    bmt.init_distributed()
    seen = [default_layout()]  # no layer: whole
    megatron = ColumnParallelLinear(D, FF, gather_input=False)
    seen.append(default_layout())  # whole
    sequence = RowParallelLinear(FF, D)  # BMTrain's default: hands on token slices
    seen.append(default_layout())  # partial
    sequence.all_reduce_output = True  # the flag read when the layout is needed
    seen.append(default_layout())  # whole
    sequence.all_reduce_output = False
    twin = copy.deepcopy(sequence)
    del sequence
    gc.collect()
    seen.append(default_layout())  # partial: the copy makes the layout too
    del twin
    gc.collect()
    seen.append(default_layout())  # whole: only the Megatron layer is left
    del megatron
    return seen


def test_the_default_layout_follows_the_live_layers_flags():
    assert run_ranks(_default_layouts, 1, timeout_s=60)[0] == [
        "whole",
        "whole",
        "partial",
        "whole",
        "partial",
        "whole",
    ]
