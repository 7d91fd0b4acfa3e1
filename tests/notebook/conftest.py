"""Shared setup for the notebook tests: a private IPython/Jupyter home, one thread
per rank, and a teardown that stops any cluster a failing test left behind, by its
cluster id (never by process name)."""
import os
import tempfile

_HOME = tempfile.mkdtemp(prefix="nbtrain-nbtests-")
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR",
             "MPLCONFIGDIR"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402


def _stop_leftover_clusters():
    from nbtrain.notebook.cluster import stop_leftover_clusters

    stop_leftover_clusters(os.environ["IPYTHONDIR"])


@pytest.fixture(scope="module", autouse=True)
def _cleanup_clusters():
    yield
    _stop_leftover_clusters()


@pytest.fixture(scope="module")
def ipython():
    """A real IPython shell with `%load_ext nbtrain` done."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbtrain")
    yield shell
    shell.run_line_magic("unload_ext", "nbtrain")
