"""Executing the research notebooks under `pytest --nbval-lax`: a private IPython/Jupyter home
for the kernels, and, after the run, any cluster a failing notebook left behind is
stopped by its cluster id (never by process name)."""
import os
import tempfile

import pytest

_HOME = tempfile.mkdtemp(prefix="nbtrain-nbval-")
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "MPLCONFIGDIR"):
    os.environ.setdefault(_var, os.path.join(_HOME, _var.lower()))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module", autouse=True)
def _stop_clusters_left_behind():
    yield
    from nbtrain.cluster import stop_leftover_clusters

    for cluster_id in stop_leftover_clusters(os.environ["IPYTHONDIR"]):
        print(f"stopped cluster {cluster_id}, left running by a notebook")
