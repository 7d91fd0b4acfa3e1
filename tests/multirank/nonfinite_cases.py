"""Rank functions for test_nonfinite_origin.py: an Inf made on rank 1 at one step, in
forward or only in backward, found by nbtrain.debug.detect_nonfinite."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 5


class _Clock:
    step = 0


class ForwardBomb(nn.Module):
    """Multiplies by Inf on rank 1 at step `at`; the identity elsewhere."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def forward(self, x):
        if dist.get_rank() == 1 and _Clock.step == self.at:
            return x * float("inf")
        return x


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class BackwardBomb(nn.Module):
    """The identity whose backward multiplies by Inf on rank 1 at step `at`."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def forward(self, x):
        if dist.get_rank() == 1 and _Clock.step == self.at:
            return _InfGrad.apply(x)
        return x


def _model(bomb):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), bomb, nn.Linear(8, 3))


def _train(model, watch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        _Clock.step = step
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        watch.step()


def _as_tuple(origin):
    return None if origin is None else (origin.step, origin.module, origin.rank, origin.direction)


def origins():
    """The reported origin of a forward Inf (rank 1, step 3) and of a backward-only Inf
    (rank 1, step 2) in ZeRO-3 models; the switch off installs no hook; the events."""
    import nbtrain
    from nbtrain.comm import events

    nbtrain.init_distributed()
    out = {}
    for case, bomb in (("forward", ForwardBomb(3)), ("backward", BackwardBomb(2))):
        model = nbtrain.wrap(_model(bomb), zero_level=3)
        seen, before = [], _hooks(model)
        events.subscribe(seen.append)
        with nbtrain.debug.detect_nonfinite(model) as watch:
            out[case + "_hooks_added"] = _hooks(model) - before
            _train(model, watch)
        events.unsubscribe(seen.append)
        out[case] = _as_tuple(watch.report())
        out[case + "_local"] = [_as_tuple(o) for o in watch.origins]
        out[case + "_hooks_left"] = _hooks(model) - before
        out[case + "_events"] = [
            (e["step"], e["label"], e["direction"], e["rank"])
            for e in seen
            if e["type"] == "nonfinite"
        ]
        out[case + "_marks"] = [
            e["step"] for e in seen if e["type"] == "metric" and "nonfinite" in e
        ]
    model = nbtrain.wrap(_model(ForwardBomb(3)), zero_level=3)
    before = _hooks(model)
    watch = nbtrain.debug.detect_nonfinite(model, enabled=False)
    out["off_hooks_added"] = _hooks(model) - before
    _train(model, watch)
    out["off_report"] = watch.report()
    return out


def _hooks(model):
    return sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
        for m in model.modules()
    )


def after_training():
    """A watch opened after 4 steps an OptimManager already took (a notebook that
    trained before): an Inf at the watch's step 1 is reported at step 1, and its events
    carry the process's step (5), the one the dashboard's loss axis shows."""
    import nbtrain
    from nbtrain.comm import events
    from nbtrain.optim import OptimManager

    nbtrain.init_distributed()
    model = nbtrain.wrap(_model(ForwardBomb(-1)), zero_level=3)
    manager = OptimManager()
    manager.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step():
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
        manager.backward(F.mse_loss(model(x), y))
        manager.step()
        manager.zero_grad()

    for _ in range(4):
        step()
    seen = []
    events.subscribe(seen.append)
    model[2].at = _Clock.step = 1
    with nbtrain.debug.detect_nonfinite(model) as watch:
        for watch_step in range(3):
            _Clock.step = watch_step
            step()
    events.unsubscribe(seen.append)
    return {
        "origin": _as_tuple(watch.report()),
        "marks": [e["step"] for e in seen if e["type"] == "metric" and "nonfinite" in e],
        "process_step": events.HUB.step,
    }
