"""A backward pass that raises half way (an error in user code, an interrupted cell)
leaves nothing behind: after `zero_grad()` the next steps equal plain PyTorch.

The error is raised between two layers, so the layers after it have already queued
their gradient reductions (and, at ZeRO-3 and ZeRO-2, left blocks gathered) when
backward stops. Stale reductions must not leak into the next step's gradients, and
blocks gathered before the optimizer step must not serve stale parameters.
"""

import lm_cases
import pytest
import torch
from support import cases
from support.ranks import run_ranks

import nbtrain as nbt

STEPS, FAIL_AT = 5, 1


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def _arm(module):
    """Makes `module`'s output raise in backward while `module.fail` is set."""
    module.fail = False
    module.register_forward_hook(
        lambda m, args, out: _RaiseInBackward.apply(out) if m.fail else out
    )


def _models(kind: str, zero_level: int, sharded: bool):
    if kind == "gpt":
        model = cases.sharded_model("wrap", zero_level, False) if sharded else cases.plain_model()
        return model, model.layers[1], cases.batches(2, STEPS)
    plain = lm_cases.PlainLM()
    model = lm_cases.ShardedLM(plain, zero_level) if sharded else plain
    return model, model.layers[1], lm_cases.batches(2)


def _train(kind: str, zero_level: int, sharded: bool):
    model, layer, (xs, ys) = _models(kind, zero_level, sharded)
    _arm(layer)
    rows = slice(nbt.rank() * 2, nbt.rank() * 2 + 2) if sharded else slice(None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        layer.fail = s == FAIL_AT
        loss = model.loss(xs[s, rows], ys[s, rows])
        try:
            loss.backward()
        except RuntimeError as exc:
            assert s == FAIL_AT and "boom" in str(exc)
            opt.zero_grad()
            continue
        opt.step()
        losses.append((nbt.sum_loss(loss) if sharded else loss).item())
    return losses, model.state_dict()


@pytest.mark.parametrize("kind,zero_level", [("gpt", 3), ("gpt", 2), ("lm", 3)])
def test_training_after_a_failed_backward_matches_plain(kind, zero_level):
    assert cases.BATCH_PER_RANK == lm_cases.ROWS_PER_RANK == 2
    ref_losses, ref_state = _train(kind, zero_level, sharded=False)
    for losses, state in run_ranks(_train, 2, kind, zero_level, True):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
