"""A small pytest project in a folder, run by a fresh pytest: for the tests of the test
suite's own plugins (the collection guard, the state guard, the module order, the timing
table, the tutorials' conftest).

The child pytest loads no installed plugin unless asked (`-p xdist`), and inherits no
PYTEST_* or NBTRAIN_TEST* variable of this run (a random module order, a timing file, a
test home of this process): what it does is the project's alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def write_project(root: Path, files: dict[str, str], ini: str = "[pytest]\n") -> Path:
    """`files` (path relative to `root` -> text) and a pytest.ini under `root`."""
    (root / "pytest.ini").write_text(ini)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run_pytest(
    root: Path, *args: str, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess:
    """`python -m pytest -p no:cacheprovider ARGS` in `root`, output captured; `env`
    adds variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NBTRAIN_TEST"))}
    clean["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no nbval/timeout/...: fast and isolated
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=root,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
