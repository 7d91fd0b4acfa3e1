"""Project-wide test settings.

Triton kernels are defined compiled or interpreted at import time, so the
interpreter switch must be set before anything imports nbtrain.kernels; doing it
here, in the root conftest, makes collection order irrelevant.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # torch missing: every test module will say so itself
    pass
