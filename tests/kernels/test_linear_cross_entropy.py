"""linear_cross_entropy: chunked Triton path against the plain composition."""

import pytest
import torch
from kernel_testing import DEVICE, TOL, dtypes_for_device

import nbtrain.kernels as K
from nbtrain.kernels.linear_cross_entropy import default_chunk_tokens


def _inputs(batch_shape, hidden, vocab, dtype, with_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*batch_shape, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype).to(DEVICE)
    bias = (0.1 * torch.randn(vocab, generator=gen)).to(dtype).to(DEVICE) if with_bias else None
    target = torch.randint(0, vocab, batch_shape, generator=gen)
    target.view(-1)[1::4] = -100
    return h, weight, bias, target.to(DEVICE)


def _run(impl, h, weight, bias, target, upstream=None, **kwargs):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (h, weight, bias)]
    loss = K.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], impl=impl, **kwargs)
    loss.backward(upstream if upstream is not None else torch.ones_like(loss))
    return [loss.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", dtypes_for_device())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing,with_bias", [(0.0, True), (0.1, False)])
def test_matches_composition(dtype, reduction, label_smoothing, with_bias):
    h, weight, bias, target = _inputs((3, 13), 33, 1000, dtype, with_bias)
    # An upstream gradient other than 1 checks backward's rescaling (a loss scale, say).
    upstream = (
        torch.rand(3, 13, device=DEVICE) + 0.5
        if reduction == "none"
        else torch.tensor(2.5, device=DEVICE)
    )
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    ours = _run("triton", h, weight, bias, target, upstream, chunk_tokens=16, **kwargs)
    ref = _run("torch", h, weight, bias, target, upstream, **kwargs)
    atol, rtol = TOL[dtype]
    for name, a, b in zip(("loss", "dhidden", "dweight", "dbias"), ours, ref):
        assert a.dtype == b.dtype, name
        # Half-precision gradients are accumulated once per chunk (3 chunks here).
        scale = 1.0 if name in ("loss", "dhidden") or dtype == torch.float32 else 4.0
        torch.testing.assert_close(
            a.float(),
            b.float(),
            atol=atol * scale,
            rtol=rtol * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_only_hidden_requires_grad_and_no_grad_mode():
    h, weight, _, target = _inputs((37,), 32, 129, torch.float32, False)
    leaf = h.clone().requires_grad_()
    K.linear_cross_entropy(leaf, weight, target, chunk_tokens=8, impl="triton").backward()
    ref = _run("torch", h, weight, None, target)
    torch.testing.assert_close(leaf.grad, ref[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss = K.linear_cross_entropy(h, weight, target, chunk_tokens=8, impl="triton")
    torch.testing.assert_close(loss, ref[0])


def test_default_chunk_keeps_about_2_pow_26_logits():
    assert default_chunk_tokens(4096, 128256) == 512
    assert default_chunk_tokens(10, 1000) == 16
    assert default_chunk_tokens(4096, 1 << 27) == 1


def test_rejects_bad_inputs_with_clear_errors():
    h, weight, _, target = _inputs((5,), 8, 50, torch.float32, False)
    with pytest.raises(TypeError, match=r"weight has dtype torch.float16; it must match hidden"):
        K.linear_cross_entropy(h, weight.half(), target)
    with pytest.raises(TypeError, match=r"hidden has dtype torch.float64; supported"):
        K.linear_cross_entropy(h.double(), weight.double(), target)
    with pytest.raises(ValueError, match=r"weight \(50, 7\) must be \(vocab, 8\)"):
        K.linear_cross_entropy(h, weight[:, :7], target)
