"""Clusters left running: this process's (stopped at exit) and other processes' (by file).

`Cluster.start` adds each cluster to `_LIVE`; `stop_leftover_clusters` is what test and
notebook teardowns call to make sure no cluster outlives them.
"""

from __future__ import annotations

import atexit
import os
import weakref

_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(_stop_all_at_exit)


def live_clusters() -> list:
    """Clusters started in this process and not yet stopped."""
    return list(_LIVE)


def stop_leftover_clusters(ipython_dir: str | None = None) -> list[str]:
    """Stops nbtrain clusters left running, by cluster id; returns the ids stopped.

    Clusters of this process are stopped directly; clusters that other processes
    (notebook kernels) started are found by their cluster files under
    `ipython_dir` (default $IPYTHONDIR) and stopped through ipyparallel. Only
    nbtrain's own clusters (ids starting "nbtrain-") are touched.
    """
    import glob

    import ipyparallel as ipp

    stopped = []
    for cluster in live_clusters():
        stopped.append(cluster.cluster_id)
        cluster.stop()
    root = ipython_dir or os.environ.get("IPYTHONDIR") or os.path.expanduser("~/.ipython")
    for path in glob.glob(os.path.join(root, "profile_*", "security", "cluster-nbtrain-*.json")):
        try:
            leftover = ipp.Cluster.from_file(path)
            stopped.append(leftover.cluster_id)
            leftover.stop_cluster_sync()
        except Exception as err:  # a half-written file of a cluster that never started
            print(f"nbtrain: could not stop the cluster of {path}: {err}")
    return stopped
