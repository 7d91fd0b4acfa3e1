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
import signal
import sys
from pathlib import Path

import pytest

try:
    from collection_guard import CollectionGuard  # tests/ is on sys.path (prepend mode)
except ImportError:  # --import-mode=importlib leaves it off
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from collection_guard import CollectionGuard
import module_order
import timing
from module_order import (  # noqa: F401
    pytest_configure_node,
    pytest_report_header,
    pytest_terminal_summary,
)
from state_guard import StateGuard

# The tests stand in for a notebook kernel, where the stop button is SIGINT and a cell
# runs with Python's default handler (ipykernel installs it around each cell). A run
# started in the background by a non-interactive shell (`cmd &`, nohup, many CI
# runners) inherits SIGINT *ignored*, and Python then never installs its handler:
# the interrupt tests' SIGINT would be dropped and they would wait out their timeout.
# Child processes (ranks, engines, kernels) inherit the disposition, so set it first.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


UNIT_DIR = Path(__file__).resolve().parent / "unit"
QUICK_LIST = Path(__file__).resolve().parent / "quick.txt"


def quick_ids() -> list[str]:
    """The node ids tests/quick.txt lists (one multi-rank test per mechanism)."""
    lines = QUICK_LIST.read_text().splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    # `bash tests/run.sh --quick` runs `-m quick`: all of tests/unit, and the tests
    # tests/quick.txt lists.
    listed = set(quick_ids())
    files = set()
    for item in items:
        files.add(item.nodeid.split("::")[0])
        if item.nodeid in listed or UNIT_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.quick)
    lost = sorted(i for i in listed - {item.nodeid for item in items} if i.split("::")[0] in files)
    if lost and not any("::" in arg for arg in config.args):
        raise pytest.UsageError(
            "tests/quick.txt lists tests their files no longer have (renamed? give the new "
            "node id): " + ", ".join(lost)
        )
    module_order.pytest_collection_modifyitems(config, items)


def pytest_addoption(parser):
    module_order.pytest_addoption(parser)
    timing.pytest_addoption(parser)


def pytest_configure(config):
    timing.install(config)
    CollectionGuard.install(config, tests_dir=Path(__file__).resolve().parent)
    StateGuard.install(config)
    module_order.configure(config)
