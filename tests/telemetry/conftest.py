"""Telemetry tests: private IPython/Jupyter homes and the multi-rank helpers on sys.path."""
import os
import sys
import tempfile

_HOME = tempfile.mkdtemp(prefix="nbtrain-telemetry-tests-")
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR",
             "MPLCONFIGDIR"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())
os.environ["OMP_NUM_THREADS"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "multirank"))  # ranks.py, cases.py
ARTIFACTS = os.path.join(os.path.dirname(HERE), "artifacts")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def dashboard_run(tmp_path_factory):
    """The dashboard notebook, executed once by nbclient: (path, recording client)."""
    import dashboard_notebook

    path = tmp_path_factory.mktemp("nb") / "dashboard.ipynb"
    return path, dashboard_notebook.run(str(path))
