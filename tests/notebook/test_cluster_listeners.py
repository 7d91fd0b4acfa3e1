"""No open doors: a running notebook cluster (controller, engines, watchdog, the ranks'
rendezvous store and gloo connections, the notebook's own process) listens on no
wildcard address. Listening sockets are read from /proc (tests/support/listeners.py)."""

import os

from support.listeners import WILDCARDS, listening


def test_a_running_cluster_listens_on_no_wildcard_address(ipython, cluster):
    # A collective first, so every rank's connections exist.
    ipython.run_cell_magic(
        "distributed",
        "",
        "import torch\nx = torch.ones(1)\nnbt.comm.all_reduce(x)\nassert x.item() == 2",
    )
    pids = sorted(set(cluster.pids()) | {os.getpid()})
    assert len(pids) >= 3, pids  # the notebook, the controller, the engines
    found = {pid: listening(pid) for pid in pids if os.path.exists(f"/proc/{pid}")}
    assert any(found.values()), found  # the controller listens (on loopback)
    wild = {pid: [s for s in socks if s[0] in WILDCARDS] for pid, socks in found.items()}
    assert not any(wild.values()), f"listening on a wildcard address: {wild}"
    # Rank 0 serves the rendezvous store, on the master address (loopback here).
    assert ("127.0.0.1", int(cluster.master_port)) in {
        s for socks in found.values() for s in socks
    }, found
