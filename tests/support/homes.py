"""A private IPython/Jupyter home for a test folder, set before IPython is imported."""

from __future__ import annotations

import os
import tempfile

HOME_VARIABLES = (
    "IPYTHONDIR",
    "JUPYTER_RUNTIME_DIR",
    "JUPYTER_DATA_DIR",
    "JUPYTER_CONFIG_DIR",
    "MPLCONFIGDIR",
)


def use_private_homes(prefix: str) -> str:
    """Point IPython, Jupyter and matplotlib at folders in a fresh temporary folder (so
    no profile, kernel spec or config of the user's home changes a test, and no test
    writes there) and give each rank one thread. Returns the temporary folder. Call it
    from a conftest at import, before anything imports IPython."""
    home = tempfile.mkdtemp(prefix=prefix)
    for var in HOME_VARIABLES:
        os.environ[var] = os.path.join(home, var.lower())
    # Made in this process: tutorials/conftest.py keeps it (a home inherited from the
    # process that started a pytest-xdist worker it replaces).
    os.environ["NBTRAIN_TEST_HOME_PID"] = str(os.getpid())
    os.environ["OMP_NUM_THREADS"] = "1"
    return home
