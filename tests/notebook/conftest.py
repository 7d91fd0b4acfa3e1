"""Shared setup for the notebook tests: a private IPython/Jupyter home, one thread per
rank, a real IPython shell and the cluster a module shares. A cluster that a test leaves
running is reported and stopped, by its cluster id (never by process name), by the state
guard (tests/state_guard.py)."""

from support.homes import use_private_homes

use_private_homes("nbtrain-nbtests-")

import pytest


@pytest.fixture(scope="module")
def ipython():
    """A real IPython shell with `%load_ext nbtrain` done."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbtrain")
    yield shell
    shell.run_line_magic("unload_ext", "nbtrain")


@pytest.fixture(scope="module")
def cluster(request, ipython):
    """The module's cluster: `%nbtrain <CLUSTER_START>` (the module's CLUSTER_START, else
    2 gloo ranks: support.notebook.CLUSTER_START), started from no cluster. At the end
    %autodistributed is turned off, the cluster stopped (if a test has not), and none of
    its processes may remain."""
    from procs import wait_gone
    from support import notebook

    from nbtrain.notebook import NoClusterError, magics
    from nbtrain.notebook.autodistribute import set_autodistributed

    with pytest.raises(NoClusterError, match="%nbtrain start"):  # no cluster left over
        ipython.run_cell_magic("distributed", "", "print('no cluster yet')")
    notebook.nbtrain(ipython, getattr(request.module, "CLUSTER_START", notebook.CLUSTER_START))
    yield magics.current_cluster()
    current = magics.current_cluster()  # a test may have restarted or stopped it
    pids = current.pids() if current is not None else []
    set_autodistributed(ipython, False)
    notebook.nbtrain(ipython, "stop")
    assert wait_gone(pids) == []  # no orphans
