"""Executing the tutorials under `pytest --nbval-lax`: a private IPython/Jupyter home
for the kernels, and, when a notebook's cells are done, any cluster it left behind
(a failing notebook never reaches its `%nbtrain stop`) is stopped by its cluster id,
never by process name."""

import os
import tempfile

# One home per pytest process. pytest-xdist's workers inherit the environment of the
# process that started them, which has imported this file too: with that home kept,
# two workers shared one IPYTHONDIR, and the teardown below in one stopped the cluster
# of the notebook running in the other as a leftover. A home made in this process
# already (by tests/support/homes.py) is kept.
if os.environ.get("NBTRAIN_TEST_HOME_PID") != str(os.getpid()):
    _HOME = tempfile.mkdtemp(prefix="nbtrain-nbval-")
    for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "MPLCONFIGDIR"):
        os.environ[_var] = os.path.join(_HOME, _var.lower())
    os.environ["NBTRAIN_TEST_HOME_PID"] = str(os.getpid())
os.environ.setdefault("OMP_NUM_THREADS", "1")


# nbval waits at most `output_timeout` (5 s) between two of a cell's output messages
# after its reply. A `--dashboard` cell sends hundreds of widget updates; on a 2-core
# machine running four test workers the kernel's IOPub thread fell 5 s behind its
# shell reply once, and the cell "timed out" after it had finished. The cell's own
# limit (--nbval-cell-timeout, pytest-timeout) still bounds a hang.
OUTPUT_TIMEOUT_S = 60


def pytest_runtest_setup(item):
    if hasattr(item, "output_timeout"):
        item.output_timeout = max(item.output_timeout, OUTPUT_TIMEOUT_S)


def pytest_runtest_teardown(item, nextitem):
    # nbval items are notebook cells, not fixtures users: a hook sees them all.
    if nextitem is not None and nextitem.parent is item.parent:
        return
    from nbtrain.notebook.cluster import stop_leftover_clusters

    for cluster_id in stop_leftover_clusters(os.environ["IPYTHONDIR"]):
        print(f"\nstopped cluster {cluster_id}, left running by {item.parent.name}")
