"""rms_norm and layer_norm, forward and backward: Triton against the torch reference."""

import pytest
import torch
from kernel_testing import DEVICE, TOL, dtypes_for_device

import nbtrain.kernels as K

# (1, 3): a single short row. Not (1, 1): there torch's own LayerNorm leaves x - mean at
# ~1e-8 instead of 0, which 1/sqrt(eps) amplifies, so the reference is the noisy side.
SHAPES = [(3, 7, 129), (1, 3), (5, 64), (2, 3, 1000)]


def _inputs(shape, dtype, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    bias = (0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE) if with_bias else None
    upstream = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return x, weight, bias, upstream


def _run(fn, impl, x, params, upstream):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, *params)]
    out = fn(*leaves, impl=impl)
    out.backward(upstream)
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def _compare(ours, ref, dtype, hidden):
    atol, rtol = TOL[dtype]
    names = ("y", "dx", "dweight", "dbias")
    for name, a, b in zip(names, ours, ref):
        assert a.dtype == b.dtype, name
        # d weight sums over every row: its error grows with the row count.
        scale = 4.0 if name in ("dweight", "dbias") else 1.0
        torch.testing.assert_close(
            a.float(),
            b.float(),
            atol=atol * scale,
            rtol=rtol * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", dtypes_for_device())
def test_rms_norm_matches_reference(shape, dtype):
    x, weight, _, upstream = _inputs(shape, dtype, False)
    ours = _run(K.rms_norm, "triton", x, (weight,), upstream)
    ref = _run(K.rms_norm, "torch", x, (weight,), upstream)
    _compare(ours, ref, dtype, shape[-1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", dtypes_for_device())
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_reference(shape, dtype, with_bias):
    x, weight, bias, upstream = _inputs(shape, dtype, with_bias)
    ours = _run(K.layer_norm, "triton", x, (weight, bias), upstream)
    ref = _run(K.layer_norm, "torch", x, (weight, bias), upstream)
    _compare(ours, ref, dtype, shape[-1])


def test_reference_agrees_with_torch_layer_norm():
    x, weight, bias, _ = _inputs((3, 7, 129), torch.float32, True)
    expected = torch.nn.functional.layer_norm(x, (129,), weight, bias, 1e-5)
    torch.testing.assert_close(K.layer_norm(x, weight, bias, impl="torch"), expected)


@pytest.mark.parametrize("fn,params", [(K.rms_norm, 1), (K.layer_norm, 2)])
def test_non_contiguous_input_is_accepted(fn, params):
    x, weight, bias, upstream = _inputs((7, 3, 129), torch.float32, True)
    strided = x.transpose(0, 1)  # (3, 7, 129), rows not evenly spaced
    args = (weight, bias)[:params]
    ours = _run(fn, "triton", strided, args, upstream.transpose(0, 1))
    ref = _run(fn, "torch", strided.contiguous(), args, upstream.transpose(0, 1).contiguous())
    _compare(ours, ref, torch.float32, 129)
    assert ours[0].is_contiguous() and ours[0].shape == strided.shape


def test_rejects_bad_inputs_with_clear_errors():
    x, weight, bias, _ = _inputs((3, 8), torch.float32, True)
    with pytest.raises(
        TypeError,
        match=r"x has dtype torch.float64; supported: torch.float32, "
        r"torch.float16, torch.bfloat16",
    ):
        K.rms_norm(x.double(), weight)
    with pytest.raises(TypeError, match=r"bias has dtype torch.int64"):
        K.layer_norm(x, weight, bias.long())
    with pytest.raises(ValueError, match=r"weight has shape \(7,\), expected \(8,\)"):
        K.layer_norm(x, weight[:7])
