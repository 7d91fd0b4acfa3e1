"""nbtrain.inspect: statistics of sharded parameters and recorded activations equal
those of the plain model on the concatenated batch (float64, 1e-6)."""

import fnmatch
import subprocess
import sys

import pytest
import torch
from support import cases
from support.ranks import run_ranks
from torch import nn

import nbtrain as nbt
from nbtrain.inspect import format_summary, inspect_model, inspect_tensor, record_tensor

TOL = 1e-6
STATS = ("mean", "std", "max", "min")


def _stats(t, prefix=""):
    t = t.detach().double().reshape(-1)
    return {
        prefix + "mean": t.mean().item(),
        prefix + "std": t.std().item(),
        prefix + "max": t.max().item(),
        prefix + "min": t.min().item(),
    }


def _assert_matches(got, want, what):
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=TOL, rel=0), (what, key)


def _rank_batch():
    rank, world = nbt.rank(), nbt.world_size()
    xs, ys = cases.batches(world, 1)
    lo, hi = rank * cases.BATCH_PER_RANK, (rank + 1) * cases.BATCH_PER_RANK
    return xs[0, lo:hi], ys[0, lo:hi]


def _inspect_sharded():
    model = cases.sharded_model("wrap", 3, False)
    before = inspect_model(model, "*")
    x, y = _rank_batch()
    model.loss(x, y).backward()
    after = inspect_model(model, "*")
    return {
        "before": before,
        "after": after,
        "layer0": inspect_model(model, "layers.0.*"),
        "head": inspect_model(model, "head.*"),
        "table": format_summary(after),
        "table_before": format_summary(before),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_inspect_model_matches_plain_model(world_size):
    results = run_ranks(_inspect_sharded, world_size, timeout_s=240)
    for other in results[1:]:  # collective: every rank gets the same answer
        assert other == results[0]
    got = results[0]

    plain = cases.plain_model()
    before = {n: {"shape": tuple(p.shape), **_stats(p)} for n, p in plain.named_parameters()}
    xs, ys = cases.batches(world_size, 1)
    plain.loss(xs[0], ys[0]).backward()  # the mean loss: equals the ranks' averaged grads
    after = {
        n: {"shape": tuple(p.shape), **_stats(p), **_stats(p.grad, "grad_")}
        for n, p in plain.named_parameters()
    }

    assert [s["name"] for s in got["before"]] == list(before)
    assert [s["name"] for s in got["after"]] == list(after)
    for summary, reference in ((got["before"], before), (got["after"], after)):
        for s in summary:
            _assert_matches(
                {k: v for k, v in s.items() if k != "name"}, reference[s["name"]], s["name"]
            )

    layer0 = [n for n in after if fnmatch.fnmatchcase(n, "layers.0.*")]
    assert layer0 and [s["name"] for s in got["layer0"]] == layer0
    assert got["layer0"] == [s for s in got["after"] if s["name"] in layer0]
    # The head is tied to the token embedding: found under its own name.
    assert [s["name"] for s in got["head"]] == ["head.weight"]
    assert {**got["head"][0], "name": "tok.weight"} == got["after"][0]

    assert all(name in got["table"] for name in after)
    assert "grad_mean" in got["table"] and "grad_mean" not in got["table_before"]
    assert len(got["table"].splitlines()) == len(after) + 1  # BMTrain's: a header, the rows


class Mixed(nn.Module):
    """Two dtypes and a frozen weight: three flat groups in one Block."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 5)
        self.frozen = nn.Parameter(torch.randn(5, 5), requires_grad=False)
        self.wide = nn.Linear(5, 3).to(torch.float64)

    def forward(self, x):
        return self.wide((torch.tanh(self.lin(x)) @ self.frozen).double()).sum()


def _inspect_mixed_block():
    torch.manual_seed(0)
    block = nbt.Block(Mixed())
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(nbt.rank()))
    block(x).backward()
    return inspect_model(block)


def test_inspect_model_block_with_groups_of_several_dtypes():
    got = run_ranks(_inspect_mixed_block, 2)
    assert got[0] == got[1]
    torch.manual_seed(0)
    plain = Mixed()
    for rank in range(2):  # the block's grads are the mean over ranks: so is the sum/2
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        (plain(x) / 2).backward()
    for s in got[0]:
        p = plain.get_parameter(s["name"])
        want = {"shape": tuple(p.shape), **_stats(p)}
        if p.grad is not None:
            want.update(_stats(p.grad, "grad_"))
        _assert_matches({k: v for k, v in s.items() if k != "name"}, want, s["name"])
    assert sorted(s["name"] for s in got[0]) == sorted(n for n, _ in plain.named_parameters())


def _record(model, x, y):
    model.layers[0].mlp.register_forward_hook(
        lambda module, args, out: record_tensor(out, "layers.0.mlp")
    )
    record_tensor(x.float(), "ignored")  # outside any inspect_tensor block
    with inspect_tensor() as inspector:
        loss = model.loss(x, y)
        record_tensor(loss, "loss")
        loss.backward()
    return inspector


def _record_sharded():
    # use_checkpoint: backward recomputes the MLP, which must not record it again.
    inspector = _record(cases.sharded_model("wrap", 3, True), *_rank_batch())
    return inspector.summary(), list(inspector)


def test_inspect_tensor_matches_plain_activation():
    world = 2
    results = run_ranks(_record_sharded, world, timeout_s=240)
    summary, iterated = results[0]
    assert results[1] == results[0] and iterated == summary

    plain = cases.plain_model()
    acts = []
    plain.layers[0].mlp.register_forward_hook(lambda m, a, out: acts.append(out))
    xs, ys = cases.batches(world, 1)
    plain.loss(xs[0], ys[0]).backward()
    act = acts[0]
    grad = torch.autograd.grad(plain.loss(xs[0], ys[0]), acts[1])[0]
    n = cases.BATCH_PER_RANK
    rank_losses = [
        plain.loss(xs[0, r * n : (r + 1) * n], ys[0, r * n : (r + 1) * n]) for r in range(world)
    ]

    assert [s["name"] for s in summary] == ["layers.0.mlp", "loss"]
    # Each rank's gradient is of its own mean loss: world x the full-batch one.
    _assert_matches(
        {k: v for k, v in summary[0].items() if k != "name"},
        {"shape": tuple(act.shape), **_stats(act), **_stats(grad * world, "grad_")},
        "layers.0.mlp",
    )
    _assert_matches(
        {k: v for k, v in summary[1].items() if k != "name"},
        {
            "shape": (world,),
            **_stats(torch.stack(rank_losses)),
            **_stats(torch.ones(world), "grad_"),
        },
        "loss",
    )
    table = format_summary(summary)
    assert "layers.0.mlp" in table and "grad_std" in table


def test_star_import():
    code = (
        "from nbtrain import *; import nbtrain; "
        "assert inspect is nbtrain.inspect and callable(inspect.inspect_model); "
        "assert config is nbtrain.config"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)


def _record_unequal():
    try:
        with inspect_tensor():
            for i in range(nbt.rank() + 1):
                record_tensor(torch.ones(2, 3), f"t{i}")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_recording_different_tensors_all_raise():
    for message in run_ranks(_record_unequal, 2):
        assert "recorded 1 to 2 tensors" in message
