"""Learning-rate schedules: warmup, each decay, stepping, state_dict round trips."""

import math

import pytest
import torch

from nbtrain import lr_scheduler as lrs


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)


def _lrs(cls, steps, **kw):
    opt = _opt()
    sched = cls(opt, start_lr=1.0, warmup_iter=4, end_iter=12, **kw)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("cls", [lrs.NoDecay, lrs.Linear, lrs.Cosine, lrs.Exponential])
def test_linear_warmup_reaches_start_lr(cls):
    assert _lrs(cls, 4)[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_decays():
    assert _lrs(lrs.NoDecay, 20)[4:] == pytest.approx([1.0] * 17)
    assert _lrs(lrs.Linear, 14)[4:] == pytest.approx([1 - i / 8 for i in range(9)] + [0.0] * 2)
    cos = _lrs(lrs.Cosine, 14)
    assert cos[8] == pytest.approx(0.5) and cos[12] == pytest.approx(0.0) and cos[14] == 0.0
    assert _lrs(lrs.Exponential, 8, gamma=0.5)[4:] == pytest.approx([0.5**i for i in range(5)])
    noam = _lrs(lrs.Noam, 12)
    assert noam[4] == pytest.approx(1 / math.sqrt(4)) and noam[2] == pytest.approx(0.25)
    assert noam[9] == pytest.approx(1 / 3)


def test_num_iter_starts_midway_and_step_jumps():
    opt = _opt()
    sched = lrs.Linear(opt, start_lr=1.0, warmup_iter=4, end_iter=12, num_iter=8)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5) == sched.current_lr
    sched.step(2)
    assert sched.num_iter == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_no_warmup():
    opt = _opt()
    lrs.Cosine(opt, start_lr=2.0, warmup_iter=0, end_iter=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)
    lrs.Noam(opt, start_lr=2.0, warmup_iter=0, end_iter=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)


@pytest.mark.parametrize("cls", [lrs.Noam, lrs.Linear, lrs.Cosine, lrs.Exponential, lrs.NoDecay])
def test_state_dict_round_trip(cls):
    a_opt, b_opt = _opt(), _opt()
    a = cls(a_opt, start_lr=1.0, warmup_iter=3, end_iter=20)
    for _ in range(7):
        a.step()
    b = cls(b_opt, start_lr=9.0, warmup_iter=1, end_iter=2)
    b.load_state_dict(a.state_dict())
    assert b.num_iter == 7 and b_opt.param_groups[0]["lr"] == a_opt.param_groups[0]["lr"]
    a.step(), b.step()
    assert b_opt.param_groups[0]["lr"] == a_opt.param_groups[0]["lr"]
