"""Telemetry tests: a private IPython/Jupyter home; the dashboard notebook, run once."""

import pytest
from support.homes import use_private_homes

use_private_homes("nbtrain-telemetry-tests-")


@pytest.fixture(scope="session")
def dashboard_run(tmp_path_factory):
    """The dashboard notebook, executed once by nbclient: (path, recording client)."""
    import dashboard_notebook

    path = tmp_path_factory.mktemp("nb") / "dashboard.ipynb"
    return path, dashboard_notebook.run(str(path))
