"""Shared settings for the kernel tests (conftest.py has already set TRITON_INTERPRET)."""

import pytest
import torch

# bf16 arithmetic is wrong in Triton's interpreter, so bf16 runs on a GPU only.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (bf16 is wrong in the Triton interpreter)",
)

# Tolerances per dtype: (atol, rtol) for values compared after casting to fp32.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def dtypes_for_device():
    """fp32 and fp16 everywhere; bf16 only as a GPU-marked case that skips on CPU."""
    return [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=(gpu, requires_gpu))]
