"""Shared setup for the notebook tests: a private IPython/Jupyter home and one thread
per rank. A cluster that a test leaves running is reported and stopped, by its cluster
id (never by process name), by the state guard (tests/state_guard.py)."""
import os
import tempfile

_HOME = tempfile.mkdtemp(prefix="nbtrain-nbtests-")
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR",
             "MPLCONFIGDIR"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ipython():
    """A real IPython shell with `%load_ext nbtrain` done."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbtrain")
    yield shell
    shell.run_line_magic("unload_ext", "nbtrain")
