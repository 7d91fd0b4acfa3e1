"""AdamOptimizer in one process: fp32 parameters equal torch.optim.Adam (L2 weight
decay, BMTrain's rule) or, with decoupled_weight_decay=True, torch.optim.AdamW; bf16
parameters decouple the decay and keep an fp32 master."""

import pytest
import torch

from nbtrain.optim import AdamOffloadOptimizer, AdamOptimizer

HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (7, 130, 1)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in (7, 130, 1)]


@pytest.mark.parametrize("cls", [AdamOptimizer, AdamOffloadOptimizer])
@pytest.mark.parametrize(
    "decoupled,ref_cls",
    [(None, torch.optim.Adam), (False, torch.optim.Adam), (True, torch.optim.AdamW)],
)
def test_fp32_matches_torch_adam_or_adamw(cls, decoupled, ref_cls):
    ours, ref = _params(), _params()
    opt = cls(ours, decoupled_weight_decay=decoupled, **HYPER)
    ref_opt = ref_cls(ref, foreach=False, **HYPER)
    for step in range(12):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 5:  # a parameter without a gradient is left alone, its step count too
            ours[1].grad = ref[1].grad = None
        opt.step(), ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert opt.state[ours[1]]["step"] == 11


def test_bf16_parameters_keep_fp32_master_and_read_main_grad():
    ours, ref = (
        _params(torch.bfloat16),
        [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16)],
    )
    opt, ref_opt = AdamOptimizer(ours, **HYPER), torch.optim.AdamW(ref, **HYPER)
    for step in range(12):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.main_grad, q.grad = g.clone(), g.clone()  # fp32 gradient, as a Block leaves it
        opt.step(), ref_opt.step()
    for p, q in zip(ours, ref):
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(master, q.detach(), atol=1e-6, rtol=1e-6)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    opt.zero_grad()
    assert all(p.main_grad is None and p.grad is None for p in ours)


def test_state_dict_keeps_fp32_state_for_bf16_parameters():
    params = _params(torch.bfloat16)
    opt = AdamOptimizer(params, **HYPER)
    for p, g in zip(params, _grads(0)):
        p.grad = g.to(torch.bfloat16)
    opt.step()
    other = AdamOptimizer(params, lr=5.0)
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["lr"] == HYPER["lr"]
    for p in params:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert other.state[p][key].dtype == torch.float32
            assert torch.equal(other.state[p][key], opt.state[p][key])


def test_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        AdamOptimizer(_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        AdamOptimizer(_params(), lr=-1.0)
    with pytest.raises(ValueError, match="decoupled_weight_decay='yes'"):
        AdamOptimizer(_params(), decoupled_weight_decay="yes")
    with pytest.raises(ValueError, match="scale=0"):
        AdamOptimizer(_params()).step(scale=0)


@pytest.mark.parametrize("cls", [AdamOptimizer, AdamOffloadOptimizer])
def test_hold_steps_warm_the_moments_without_moving_the_weights(cls):
    """BMTrain's hold_steps: torch's Adam with lr 0 for those steps, then the lr."""
    ours, ref = _params(), _params()
    start = [p.detach().clone() for p in ours]
    opt, ref_opt = cls(ours, hold_steps=3, **HYPER), torch.optim.Adam(ref, **HYPER)
    for step in range(8):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        ref_opt.param_groups[0]["lr"] = 0.0 if step < 3 else HYPER["lr"]
        opt.step(), ref_opt.step()
        if step == 2:
            for p, s in zip(ours, start):
                assert torch.equal(p.detach(), s)  # held
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


def test_optim_manager_scale_loss_and_bmtrains_counter():
    from nbtrain.optim import OptimManager

    manager = OptimManager(loss_scale=1024)
    assert manager.scale_loss(torch.tensor(2.0)).item() == 2048.0
    assert manager.steps_since_last_scale == 0
    assert OptimManager().scale_loss(torch.tensor(2.0)).item() == 2.0


def test_optim_manager_grad_scale_is_bmtrains_divisor():
    from nbtrain.optim import OptimManager

    assert OptimManager().grad_scale == 1  # one process: the data-parallel size
    halved = OptimManager(loss_scale=8, grad_scale=2)  # BMTrain: loss * 8 / 2 summed over 1 rank
    assert halved.scale_loss(torch.tensor(1.0)).item() == 4.0


@pytest.mark.parametrize("cls", [AdamOptimizer, AdamOffloadOptimizer])
def test_loads_bmtrains_optimizer_state_layout(cls):
    """BMTrain names the fp32 master `_param_fp32` (its offload optimizer keeps one for
    fp32 parameters too, and may carry host staging buffers): loaded, training goes
    on exactly as from nbtrain's own state dict."""
    runs = []
    for convert in (False, True):
        params = _params(torch.bfloat16)[:2] + _params()[2:]
        opt = cls(params, **HYPER)
        for step in range(3):
            for p, g in zip(params, _grads(step)):
                p.grad = g.to(p.dtype)
            opt.step()
        saved = opt.state_dict()
        if convert:
            for index, entry in saved["state"].items():
                param = params[index]
                master = entry.pop("master", None)
                entry["_param_fp32"] = master if master is not None else param.detach().float()
                entry["_grad_fp32"] = torch.full_like(entry["_param_fp32"], float("nan"))
        fresh = cls(params, **HYPER)
        fresh.load_state_dict(saved)
        for step in range(3, 5):
            for p, g in zip(params, _grads(step)):
                p.grad = g.to(p.dtype)
            fresh.step()
        runs.append([p.detach().clone() for p in params])
        assert all("_grad_fp32" not in st for st in fresh.state.values())
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_optim_manager_loads_bmtrains_keys_and_refuses_gather_opt():
    from nbtrain.optim import OptimManager

    manager = OptimManager(loss_scale=1024)
    manager.add_optimizer(AdamOptimizer(_params(), **HYPER))
    state = manager.state_dict()
    assert state["loss_scale_enabled"] is True
    bmtrain_keys = {k: state[k] for k in ("optimizers", "lr_schedulers", "loss_scale")}
    other = OptimManager()
    other.add_optimizer(AdamOptimizer(_params(), **HYPER))
    other.load_state_dict({**bmtrain_keys, "loss_scale": 512.0, "loss_scale_enabled": True})
    assert other.loss_scale == 512.0 and other.loss_scale_enabled
    with pytest.raises(NotImplementedError, match="gather_opt=True.*save_checkpoint"):
        manager.state_dict(gather_opt=True)
