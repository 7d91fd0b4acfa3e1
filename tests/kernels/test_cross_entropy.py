"""cross_entropy and FusedCrossEntropy: Triton against the torch reference."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import DEVICE, TOL, dtypes_for_device

import nbtrain.kernels as K
from nbtrain.nn.loss import FusedCrossEntropy

SHAPES = [((5,), 1000), ((2,), 50257), ((3, 7), 129)]


def _inputs(batch_shape, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*batch_shape, vocab, generator=gen) * 3).to(dtype).to(DEVICE)
    target = torch.randint(0, vocab, batch_shape, generator=gen)
    target.view(-1)[::3] = -100  # every third row ignored, the first one included
    return logits, target.to(DEVICE)


def _run(impl, logits, target, upstream=None, **kwargs):
    leaf = logits.clone().requires_grad_()
    loss = K.cross_entropy(leaf, target, impl=impl, **kwargs)
    loss.backward(upstream if upstream is not None else torch.ones_like(loss))
    return loss.detach(), leaf.grad.clone()


@pytest.mark.parametrize("batch_shape,vocab", SHAPES)
@pytest.mark.parametrize("dtype", dtypes_for_device())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_reference(batch_shape, vocab, dtype, reduction, label_smoothing):
    logits, target = _inputs(batch_shape, vocab, dtype)
    # An upstream gradient other than 1 checks backward's rescaling (a loss scale, say).
    upstream = torch.tensor(2.5, device=DEVICE)
    if reduction == "none":
        upstream = torch.rand(batch_shape, device=DEVICE) + 0.5
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, grad = _run("triton", logits, target, upstream, **kwargs)
    ref_loss, ref_grad = _run("torch", logits, target, upstream, **kwargs)
    atol, rtol = TOL[dtype]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=atol, rtol=rtol)
    ignored = target == -100
    assert grad[ignored].abs().max() == 0
    if reduction == "none":
        assert loss.shape == batch_shape and loss[ignored].abs().max() == 0


def test_gradient_overwrites_logits_and_bumps_their_version():
    logits, target = _inputs((5,), 1000, torch.float32)
    leaf = logits.clone().requires_grad_()
    version = leaf._version
    K.cross_entropy(leaf, target, impl="triton").backward()
    assert leaf._version > version
    torch.testing.assert_close(leaf.detach(), leaf.grad)  # the same storage now


def test_an_op_that_saved_the_logits_fails_loudly():
    logits, target = _inputs((5,), 1000, torch.float32)
    leaf = logits.clone().requires_grad_()
    capped = torch.tanh(leaf)  # tanh saves its output for backward
    loss = K.cross_entropy(capped, target, impl="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_non_contiguous_logits_are_copied_and_left_untouched():
    logits, target = _inputs((3, 7), 129, torch.float32)
    wide = logits.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # (3, 7, V) strided
    assert not wide.is_contiguous()
    before = wide.detach().clone()
    loss = K.cross_entropy(wide, target, impl="triton")
    loss.backward()
    assert torch.equal(wide.detach(), before)
    _, ref_grad = _run("torch", logits, target)
    torch.testing.assert_close(wide.grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_no_grad_leaves_logits_untouched():
    logits, target = _inputs((5,), 1000, torch.float16)
    before = logits.clone()
    with torch.no_grad():
        loss = K.cross_entropy(logits, target, impl="triton")
    assert torch.equal(logits, before)
    torch.testing.assert_close(
        loss, K.cross_entropy(logits, target, impl="torch"), atol=2e-3, rtol=2e-3
    )


def test_all_rows_ignored_gives_nan_mean_like_torch():
    logits, target = _inputs((4,), 33, torch.float32)
    target.fill_(-100)
    loss, grad = _run("triton", logits, target)
    assert torch.isnan(loss) and torch.isnan(_run("torch", logits, target)[0])
    assert grad.abs().max() == 0


def test_int32_targets_and_custom_ignore_index():
    logits, target = _inputs((5,), 1000, torch.float32)
    target = torch.where(target == -100, torch.full_like(target, 7), target).int()
    loss, grad = _run("triton", logits, target, ignore_index=7)
    ref_loss, ref_grad = _run("torch", logits, target, ignore_index=7)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)


def test_rejects_bad_inputs_with_clear_errors():
    logits, target = _inputs((5,), 100, torch.float32)
    with pytest.raises(
        TypeError, match=r"logits have dtype torch.float64; supported: torch.float32"
    ):
        K.cross_entropy(logits.double(), target)
    with pytest.raises(TypeError, match=r"target has dtype torch.float32"):
        K.cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match="reduction='avg'"):
        K.cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="plus a class dimension"):
        K.cross_entropy(logits, target[:4])
    with pytest.raises(ValueError, match="outside"):
        K.cross_entropy(logits, target, label_smoothing=1.5)


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_cross_entropy_module(inplace):
    logits, target = _inputs((3, 7), 129, torch.float32)
    module = FusedCrossEntropy(ignore_index=-100, reduction="mean", inplace=inplace, impl="triton")
    leaf = logits.clone().requires_grad_()
    loss = module(leaf, target)
    loss.backward()
    ref_loss, ref_grad = _run("torch", logits, target)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(leaf.grad, ref_grad)
    assert torch.equal(leaf.detach(), logits) != inplace


@pytest.mark.parametrize("dtype", dtypes_for_device())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_cross_entropy_class_weights_match_torch(dtype, reduction, label_smoothing):
    """BMTrain's FusedCrossEntropy(weight=...): F.cross_entropy's weighted loss (a
    row's loss times its target's weight; "mean" over the kept rows' weights)."""
    logits, target = _inputs((3, 7), 129, dtype)
    weight = torch.rand(129, generator=torch.Generator().manual_seed(1)) + 0.5
    upstream = torch.rand(3, 7, device=DEVICE) + 0.5 if reduction == "none" else None
    leaf = logits.clone().requires_grad_()
    # BMTrain's order: weight comes first; given in the logits' dtype, as its test does.
    loss = FusedCrossEntropy(
        weight.to(dtype).to(DEVICE), reduction=reduction, label_smoothing=label_smoothing
    )(leaf, target)
    loss.backward(upstream if upstream is not None else torch.ones_like(loss))
    ref_leaf = logits.float().clone().requires_grad_()
    ref = F.cross_entropy(
        ref_leaf.reshape(-1, 129),
        target.reshape(-1),
        weight=weight.to(dtype).float().to(DEVICE),
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    ref = ref.reshape(3, 7) if reduction == "none" else ref
    ref.backward(upstream if upstream is not None else torch.ones_like(ref))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad, rtol=rtol, atol=atol)
    unweighted = FusedCrossEntropy(reduction=reduction)(logits.clone(), target)
    assert not torch.allclose(loss, unweighted)  # the weights changed the loss


def test_fused_cross_entropy_refuses_a_weight_of_the_wrong_size():
    logits, target = _inputs((5,), 10, torch.float32)
    with pytest.raises(ValueError, match=r"one weight per class, shape \(10,\)"):
        FusedCrossEntropy(weight=torch.ones(9))(logits, target)
    with pytest.raises(ValueError, match="1-D tensor"):
        FusedCrossEntropy(weight=torch.ones(2, 5))
