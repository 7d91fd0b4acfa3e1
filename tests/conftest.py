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


# Fail a run over the whole tests/ folder that silently leaves a test file out
# (a folder matching norecursedirs, a name not matching python_files): see
# tests/collection_guard.py.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

try:
    from collection_guard import CollectionGuard  # tests/ is on sys.path (prepend mode)
except ImportError:  # --import-mode=importlib leaves it off
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from collection_guard import CollectionGuard


def pytest_configure(config):
    CollectionGuard.install(config, tests_dir=Path(__file__).resolve().parent)
