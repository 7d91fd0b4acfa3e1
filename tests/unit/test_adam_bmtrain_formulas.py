"""AdamOptimizer and AdamOffloadOptimizer against BMTrain's update, written out here.

BMTrain steps an fp32 parameter with torch's functional Adam (weight decay as L2: the
gradient, divided by the loss scale, plus wd * p feeds the moments) and an fp16/bf16
parameter with its fused kernel on an fp32 master copy:
    p32 = p32 - lr * m / bc1 / (sqrt(v / bc2) + eps) - lr * wd * p32
(decoupled decay, bias corrections bc = 1 - beta**step), the half parameter being the
master rounded. The reference below runs those formulas in float64.
"""

import math

import pytest
import torch

from nbtrain.optim import AdamOffloadOptimizer, AdamOptimizer

LR, BETAS, EPS, WD = 1e-2, (0.8, 0.95), 1e-6, 0.1
SIZES = (7, 130, 1)
STEPS = 6


def _start(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _grads(step, dtype, scale):
    """The gradients BMTrain's optimizer receives: scaled by the loss scale, in the
    parameter's dtype."""
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for n in SIZES]


def bmtrain_adam(p0, grads, scale, half, decoupled=None):
    """BMTrain's update of one parameter over several steps, in float64."""
    decoupled = half if decoupled is None else decoupled
    (b1, b2), p = BETAS, p0.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        g = grad.double() / scale
        if not decoupled:
            g = g + WD * p  # torch.optim._functional.adam(weight_decay=WD)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        if decoupled:  # BMTrain's adam_cuda.cu / adam_cpu.hpp
            p = p - LR * m / bc1 / ((v / bc2).sqrt() + EPS) - LR * WD * p
        else:
            p = p - LR / bc1 * m / (v.sqrt() / math.sqrt(bc2) + EPS)
    return p


def _run(cls, dtype, scale, **kwargs):
    params = [torch.nn.Parameter(t.clone()) for t in _start(dtype)]
    opt = cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, dtype, scale)):
            p.grad = g
        opt.step(scale=scale)  # BMTrain's call: the gradients still carry the scale
    return params, opt


@pytest.mark.parametrize("cls", [AdamOptimizer, AdamOffloadOptimizer])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_equals_bmtrains_formulas(cls, dtype, scale):
    half = dtype != torch.float32
    params, opt = _run(cls, dtype, scale)
    for i, (p, start) in enumerate(zip(params, _start(dtype))):
        grads = [_grads(step, dtype, scale)[i] for step in range(STEPS)]
        ref = bmtrain_adam(start, grads, scale, half)
        master = opt.state[p]["master"] if half else p.detach()
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.double(), ref, atol=2e-6, rtol=2e-6)
        if half:
            assert p.dtype == dtype and torch.equal(p.detach(), master.to(dtype))
        # The other form of the decay is far outside the tolerance: the check can fail.
        other = bmtrain_adam(start, grads, scale, half, decoupled=not half)
        assert (other - ref).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoupled_weight_decay_chooses_the_form_for_every_dtype(dtype):
    for decoupled in (True, False):
        params, opt = _run(AdamOptimizer, dtype, 1.0, decoupled_weight_decay=decoupled)
        for i, (p, start) in enumerate(zip(params, _start(dtype))):
            grads = [_grads(step, dtype, 1.0)[i] for step in range(STEPS)]
            ref = bmtrain_adam(start, grads, 1.0, dtype != torch.float32, decoupled=decoupled)
            master = opt.state[p]["master"] if dtype != torch.float32 else p.detach()
            torch.testing.assert_close(master.double(), ref, atol=2e-6, rtol=2e-6)
