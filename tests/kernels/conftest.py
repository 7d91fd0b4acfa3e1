"""Kernel tests run the Triton kernels through Triton's interpreter when there is no GPU.

Triton chooses interpreted or compiled kernels when a `@triton.jit` function is
defined, so TRITON_INTERPRET must be set before `nbtrain.kernels` is first imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed; the kernel tests need it")

import nbtrain.kernels as kernels  # after TRITON_INTERPRET on purpose


@pytest.fixture(scope="session", autouse=True)
def _kernels_built_for_this_device():
    if not torch.cuda.is_available() and not kernels.INTERPRETED:
        # Reloading the op modules afterwards does not work: the interpreter then fails
        # with "Cannot call @triton.jit'd outside of the scope of a kernel".
        pytest.fail(
            "nbtrain.kernels was imported (by another test or plugin) before this "
            "conftest set TRITON_INTERPRET=1; import it lazily elsewhere, or run "
            "tests/kernels on its own"
        )
