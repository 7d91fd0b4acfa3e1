"""adam_step_: Triton against the torch reference and against torch.optim.AdamW
(decoupled weight decay) and torch.optim.Adam (L2), the two forms nbtrain's
AdamOptimizer takes per dtype as BMTrain does."""

import pytest
import torch
from kernel_testing import DEVICE, requires_gpu

import nbtrain.kernels as K

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _state(n, grad_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param, exp_avg, grad = (torch.randn(n, generator=gen) for _ in range(3))
    exp_avg_sq = torch.rand(n, generator=gen)
    return [t.to(DEVICE) for t in (param, grad.to(grad_dtype), exp_avg, exp_avg_sq)]


@pytest.mark.parametrize("n", [1, 1000, 4097, 3 * 7 * 129])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("copy_dtype", [None, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_matches_reference(n, grad_dtype, copy_dtype, decoupled):
    ours, ref = _state(n, grad_dtype), _state(n, grad_dtype)
    copy = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype, device=DEVICE)
    K.adam_step_(*ours, step=3, model_copy=copy, impl="triton", decoupled=decoupled, **HYPER)
    K.adam_step_(*ref, step=3, impl="torch", decoupled=decoupled, **HYPER)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    if copy is not None:
        assert torch.equal(copy, ours[0].to(copy_dtype))


@pytest.mark.gpu
@requires_gpu
def test_bf16_grad_and_copy_on_gpu():
    ours, ref = _state(5003, torch.bfloat16), _state(5003, torch.bfloat16)
    copy = torch.empty(5003, dtype=torch.bfloat16, device=DEVICE)
    K.adam_step_(*ours, step=2, model_copy=copy, impl="triton", **HYPER)
    K.adam_step_(*ref, step=2, impl="torch", **HYPER)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(copy, ours[0].bfloat16())


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(
    "decoupled,torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)]
)
def test_three_steps_match_torch_adamw_and_adam(impl, decoupled, torch_cls):
    n = 1000
    param, grad, exp_avg, exp_avg_sq = _state(n)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    torch_param = torch.nn.Parameter(param.clone())
    opt = torch_cls(
        [torch_param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=False,
    )
    for step in (1, 2, 3):
        g = grad * step
        torch_param.grad = g.clone()
        opt.step()
        K.adam_step_(
            param, g, exp_avg, exp_avg_sq, step=step, impl=impl, decoupled=decoupled, **HYPER
        )
        assert torch.equal(g, grad * step)  # L2 adds the decay to a copy, not to grad
    torch.testing.assert_close(param, torch_param.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(exp_avg_sq, opt.state[torch_param]["exp_avg_sq"])
    torch.testing.assert_close(exp_avg, opt.state[torch_param]["exp_avg"])


def test_rejects_bad_inputs_with_clear_errors():
    param, grad, exp_avg, exp_avg_sq = _state(10)
    with pytest.raises(TypeError, match=r"param has dtype torch.float16; supported: torch.float32"):
        K.adam_step_(param.half(), grad, exp_avg, exp_avg_sq, step=1, **HYPER)
    with pytest.raises(TypeError, match=r"model_copy has dtype torch.float32; supported"):
        K.adam_step_(param, grad, exp_avg, exp_avg_sq, step=1, model_copy=param.clone(), **HYPER)
    with pytest.raises(TypeError, match=r"grad has dtype torch.float64"):
        K.adam_step_(param, grad.double(), exp_avg, exp_avg_sq, step=1, **HYPER)
    with pytest.raises(ValueError, match="not contiguous"):
        K.adam_step_(
            param, torch.randn(20, device=DEVICE)[::2], exp_avg, exp_avg_sq, step=1, **HYPER
        )
    with pytest.raises(ValueError, match="elements"):
        K.adam_step_(param, grad[:5], exp_avg, exp_avg_sq, step=1, **HYPER)
    with pytest.raises(ValueError, match="step counts from 1"):
        K.adam_step_(param, grad, exp_avg, exp_avg_sq, step=0, **HYPER)


def test_shapes_may_differ_when_flat_sizes_match():
    ours, ref = _state(21), _state(21)
    ours[0] = ours[0].view(3, 7)
    K.adam_step_(*ours, step=1, impl="triton", **HYPER)
    K.adam_step_(*ref, step=1, impl="torch", **HYPER)
    torch.testing.assert_close(ours[0].reshape(-1), ref[0], atol=1e-6, rtol=1e-6)
