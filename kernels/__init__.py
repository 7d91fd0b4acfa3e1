"""Fused kernels for the GPU path: AdamW step, cross-entropy, linear + cross-entropy,
RMSNorm and LayerNorm.

Each op lives in its own file (kernel, launcher, autograd Function, torch reference);
this module owns the public functions and the one dispatch rule:

- `impl="auto"`: Triton when every tensor is on CUDA and triton is installed, else the
  torch reference (so CPU training works without triton).
- `impl="triton"`: always Triton. CPU tensors need `TRITON_INTERPRET=1` in the
  environment before `nbtrain.kernels` is first imported (Triton picks interpreted or
  compiled kernels when they are defined); that is how the CPU tests run the kernels.
- `impl="torch"`: always the torch reference.

Importing `nbtrain` does not import this module (nor triton); only
`import nbtrain.kernels` does.
"""


def _hand_over() -> bool:
    """Imported by its folder's name, `kernels` (a script, pytest or a Jupyter kernel
    started in the checkout's root puts the root on sys.path), this package would hide
    any installed package of that name, such as Hugging Face's `kernels`, which
    transformers imports. Then the installed one takes its place in `sys.modules`, and
    True; this package itself is always `nbtrain.kernels`."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what `import kernels` returns once this ends
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over():
    from . import adam as _adam
    from . import cross_entropy as _ce
    from . import layer_norm as _ln
    from . import linear_cross_entropy as _lce
    from . import rms_norm as _rms
    from ._triton import HAS_TRITON, INTERPRETED

IMPLS = ("auto", "triton", "torch")

__all__ = [
    "adam_step_",
    "cross_entropy",
    "linear_cross_entropy",
    "rms_norm",
    "layer_norm",
    "pick_impl",
    "HAS_TRITON",
    "INTERPRETED",
]


def pick_impl(impl, *tensors, op="kernel"):
    """Resolves `impl` to "triton" or "torch" for these tensors (the one dispatch rule).

    Args:
        impl: "auto", "triton" or "torch".
        *tensors: the op's tensor inputs (None entries are ignored).
        op: the op's name, used in error messages.

    Raises:
        ValueError: `impl` is not one of IMPLS.
        RuntimeError: `impl="triton"` but triton is missing, or the tensors are on CPU
            and the kernels were not defined under `TRITON_INTERPRET=1`.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r}; expected one of {', '.join(IMPLS)}")
    if impl == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if impl == "auto":
        return "triton" if on_cuda and HAS_TRITON and not INTERPRETED else "torch"
    if not HAS_TRITON:
        raise RuntimeError(
            f"{op}: impl='triton' needs the triton package "
            "(pip install 'nbtrain[gpu]'); impl='torch' runs without it"
        )
    if not on_cuda and not INTERPRETED:
        raise RuntimeError(
            f"{op}: impl='triton' on CPU tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before the first `import nbtrain.kernels`"
        )
    return "triton"


def adam_step_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    model_copy=None,
    impl="auto",
    decoupled=True,
):
    """One in-place Adam step with bias correction and weight decay.

    Matches `torch.optim.AdamW` (decoupled=True: p -= lr * wd * p) or `torch.optim.Adam`
    (decoupled=False: L2, grad + wd * p feeds the moments) for one step with the same
    hyper-parameters. nbtrain's AdamOptimizer picks per dtype, as BMTrain does: L2
    for fp32 parameters, decoupled for fp16/bf16 ones.

    Args:
        param: master weights, fp32, any shape, contiguous; updated in place.
        grad: gradient, fp32, fp16 or bf16, same number of elements, contiguous.
        exp_avg, exp_avg_sq: Adam moments, fp32, contiguous; updated in place.
        lr, beta1, beta2, eps, weight_decay: Python floats.
        step: this step's number, counting from 1 (bias correction uses it).
        model_copy: optional bf16/fp16 tensor of the same size, overwritten with the
            new `param` in the same pass.
        impl: "auto", "triton" or "torch" (see the module docstring).
        decoupled: the weight decay's form (above).

    Raises:
        TypeError: an unsupported dtype (the message names it and what is supported).
        ValueError: mismatched sizes or devices, a non-contiguous tensor, step < 1.
    """
    _adam.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, model_copy, step)
    which = pick_impl(impl, param, grad, exp_avg, exp_avg_sq, model_copy, op="adam_step_")
    run = _adam.adam_step_triton if which == "triton" else _adam.adam_step_torch
    run(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        model_copy=model_copy,
        decoupled=decoupled,
    )


def cross_entropy(
    logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, impl="auto"
):
    """Cross-entropy over the last dimension of `logits`, autograd-aware.

    Same value as `F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1), ...)`.
    On the Triton path the gradient is computed during the forward pass and, when
    `logits` requires grad, written into the logits' own storage: afterwards `logits`
    holds the gradient, not the logits (autograd raises if another op saved them).
    Logits that `reshape(-1, V)` cannot view with unit stride are copied first, and
    then the caller's tensor is left untouched. `impl="torch"` never writes to logits.

    Args:
        logits: (..., V) fp32, fp16 or bf16.
        target: (...) int64 or int32 class indices in [0, V), or `ignore_index`.
        ignore_index: target value whose rows add no loss and get zero gradient.
        reduction: "mean" (over non-ignored rows; NaN if there are none, as in torch),
            "sum" or "none" (loss per row, shape of `target`, 0 at ignored rows).
        label_smoothing: in [0, 1], as in `F.cross_entropy`.
        impl: "auto", "triton" or "torch".

    Returns:
        The loss in fp32, whatever the logits' dtype.
    """
    _ce.check_ce_inputs(logits, target, reduction, label_smoothing, op="cross_entropy")
    if pick_impl(impl, logits, target, op="cross_entropy") == "torch":
        return _ce.cross_entropy_torch(logits, target, ignore_index, reduction, label_smoothing)
    return _ce.cross_entropy_triton(logits, target, ignore_index, reduction, label_smoothing)


def linear_cross_entropy(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    chunk_tokens=None,
    impl="auto",
):
    """`cross_entropy(hidden @ weight.T + bias, target)` without materialising all logits.

    The Triton path walks the tokens in chunks of `chunk_tokens`: per chunk it forms
    the logits, turns them into their gradient in place with the cross-entropy kernel,
    and folds that into the gradients of hidden, weight and bias, so only one chunk of
    logits exists at a time. Weight and bias gradients accumulate in their own dtype.

    Args:
        hidden: (..., H) fp32, fp16 or bf16.
        weight: (V, H), same dtype as hidden (the output projection / LM head).
        target: (...) int64 or int32, the shape of hidden without its last dimension.
        bias: optional (V,), same dtype.
        ignore_index, reduction, label_smoothing: as in `cross_entropy`.
        chunk_tokens: tokens per chunk; default keeps a chunk of logits near 2**26
            elements (128 MiB in bf16).
        impl: "auto", "triton" or "torch" (the torch path is the plain composition).

    Returns:
        The loss in fp32.
    """
    _lce.check_lce_inputs(hidden, weight, bias, target, reduction, label_smoothing)
    if pick_impl(impl, hidden, weight, bias, target, op="linear_cross_entropy") == "torch":
        return _lce.linear_cross_entropy_torch(
            hidden, weight, bias, target, ignore_index, reduction, label_smoothing
        )
    return _lce.linear_cross_entropy_triton(
        hidden, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_tokens
    )


def rms_norm(x, weight, eps=1e-6, impl="auto"):
    """RMSNorm over the last dimension: `x / sqrt(mean(x**2) + eps) * weight`.

    Computed in fp32 and returned in `x.dtype` (contiguous, shape of x). Input whose
    rows `reshape(-1, H)` cannot view with unit stride is copied first.

    Args:
        x: (..., H) fp32, fp16 or bf16.
        weight: (H,) fp32, fp16 or bf16.
        eps: added to the mean square.
        impl: "auto", "triton" or "torch".
    """
    _rms.check_norm_inputs(x, weight, None, op="rms_norm")
    if pick_impl(impl, x, weight, op="rms_norm") == "torch":
        return _rms.rms_norm_torch(x, weight, eps)
    return _rms.rms_norm_triton(x, weight, eps)


def layer_norm(x, weight, bias=None, eps=1e-5, impl="auto"):
    """LayerNorm over the last dimension, as `F.layer_norm(x, (H,), weight, bias, eps)`.

    Computed in fp32 and returned in `x.dtype`; same layout rule as `rms_norm`.

    Args:
        x: (..., H) fp32, fp16 or bf16.
        weight: (H,) fp32, fp16 or bf16.
        bias: optional (H,), same dtypes as weight.
        eps: added to the variance.
        impl: "auto", "triton" or "torch".
    """
    _rms.check_norm_inputs(x, weight, bias, op="layer_norm")
    if pick_impl(impl, x, weight, bias, op="layer_norm") == "torch":
        return _ln.layer_norm_torch(x, weight, bias, eps)
    return _ln.layer_norm_triton(x, weight, bias, eps)
