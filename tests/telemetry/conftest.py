"""Telemetry tests: a private IPython/Jupyter home; the dashboard notebook, run once."""

import json
import os
from types import SimpleNamespace

import pytest
from support.homes import use_private_homes

use_private_homes("nbtrain-telemetry-tests-")


@pytest.fixture(scope="session")
def dashboard_run(tmp_path_factory):
    """The dashboard notebook, executed once by nbclient: (path, what the client recorded:
    `updates` and `cell_done`).

    Once per run, not per process: test_dashboard_kernel.py and test_dashboard_browser.py
    both read it, and pytest-xdist (`--dist loadfile`) puts them in different workers,
    which each executed it (a kernel, a 2-engine cluster and 16 steps: 15-25 s, 13 s of
    CPU). The first worker to get here executes it under a file lock and writes the
    notebook and the client's record beside the workers' temporary folders; the others
    wait for the lock and read them. The record's times are time.monotonic(), one clock
    for every process of the machine, and the tests compare them with each other only.
    """
    import dashboard_notebook

    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing to share
        path = tmp_path_factory.mktemp("nb") / "dashboard.ipynb"
        client = dashboard_notebook.run(str(path))
        return path, SimpleNamespace(updates=client.updates, cell_done=client.cell_done)
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "telemetry-dashboard-notebook"
    shared.mkdir(exist_ok=True)
    path, record = shared / "dashboard.ipynb", shared / "client.json"
    with FileLock(str(shared / "lock"), timeout=600):
        if not record.exists():  # a worker whose run raised wrote nothing: run it again
            client = dashboard_notebook.run(str(path))
            done = {"updates": client.updates, "cell_done": client.cell_done}
            tmp = record.with_suffix(".tmp")
            tmp.write_text(json.dumps(done))
            tmp.replace(record)
        done = json.loads(record.read_text())
    return path, SimpleNamespace(
        updates=[tuple(u) for u in done["updates"]],
        cell_done={int(cell): t for cell, t in done["cell_done"].items()},
    )
