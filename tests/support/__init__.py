"""Helpers shared by nbtrain's tests, imported as a package: `from support.ranks import
run_ranks`, `from support import cases`.

Where a helper lives:

- here, in tests/support/: a helper imported from more than one test folder (ranks,
  cases, listeners), one a script imports when it runs outside pytest (runtime_cases,
  for tests/multirank/runtime_torchrun.py), and the notebook helpers (notebook: the
  magics run from a test's IPython shell; kernels: a Jupyter kernel driven by
  nbclient; homes: a private IPython/Jupyter home);
- beside its tests: a helper imported only by test modules of one folder (the per-topic
  tests/multirank/*_cases.py, tests/notebook/procs.py, tests/kernels/kernel_testing.py,
  tests/telemetry/synthetic.py, ...). Its name must not be used in another folder
  (tests/unit/test_test_layout.py checks): both folders are on sys.path in a run over
  tests/, and the second would silently import the first.

How they are found, with no sys.path line in any test file:

- tests/ is on sys.path in every pytest run: pytest's default (prepend) import mode
  puts the folder of each conftest.py and test module that is not in a package first on
  sys.path before importing it, and tests/conftest.py is always loaded. That makes
  `support` importable, and each test module's own folder (its *_cases.py) too.
- Ranks started by nbtrain.launch.run_ranks get the test run's sys.path: multiprocessing
  pickles a function by its module name, and both spawn and forkserver hand the parent's
  sys.path to the new process (the forkserver takes it once, when it starts: after
  collection, so with every collected folder on it).
- A script run as its own process (torchrun, a subprocess) gets tests/ through
  PYTHONPATH: `script_env()` below. By hand, from the checkout:
  `PYTHONPATH=.:tests python -m torch.distributed.run ... tests/multirank/torchrun_train.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = TESTS_DIR.parent


def script_env(**extra: str) -> dict:
    """os.environ for a script run as its own process, with this checkout's nbtrain and
    tests/ (so `support`) first on PYTHONPATH; `extra` overrides variables."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(REPO_DIR), str(TESTS_DIR), *kept])
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra, "PYTHONPATH": path}


def torchrun(
    script: str, *args: str, nproc: int = 2, env: dict | None = None, timeout_s: int = 180
):
    """Runs `script` (a path) under `python -m torch.distributed.run --standalone` with
    `nproc` ranks; the finished process (stdout and stderr captured as text)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), script, *map(str, args)]
    env = env if env is not None else {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
