"""The one dispatch rule in nbtrain.kernels.pick_impl."""

import pytest
import torch

import nbtrain.kernels as K


def test_auto_on_cpu_uses_the_torch_reference():
    assert K.pick_impl("auto", torch.zeros(2)) == "torch"
    assert K.pick_impl("torch", torch.zeros(2)) == "torch"


def test_forced_triton_on_cpu_runs_under_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the CPU-interpreter path is not in use")
    assert K.pick_impl("triton", torch.zeros(2)) == "triton"


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl='cuda'; expected one of auto, triton, torch"):
        K.pick_impl("cuda", torch.zeros(2), op="cross_entropy")


def test_missing_triton_is_a_clear_error_and_auto_still_works(monkeypatch):
    monkeypatch.setattr(K, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        K.pick_impl("triton", torch.zeros(2), op="rms_norm")
    x = torch.randn(3, 5)
    torch.testing.assert_close(
        K.rms_norm(x, torch.ones(5), impl="auto"),
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    )


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(K, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.pick_impl("triton", torch.zeros(2), op="cross_entropy")


def test_importing_nbtrain_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, nbtrain; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
