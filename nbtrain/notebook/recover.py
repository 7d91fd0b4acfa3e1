"""The notebook's half of failure recovery (the ranks' half is nbtrain.comm.recovery).

After a cell in which any rank raised, every rank's process group has been aborted
(the failing rank told the others through the rendezvous store); `recover_group`
rebuilds it on every rank, so the next cell's collectives work and every rank's
namespace is kept. When ranks sit in a collective that nobody will complete (a
rank blocked in a barrier its peers never enter), `abort_from_notebook` writes the
same abort key from the notebook: their collectives fail within a second.
"""

from __future__ import annotations

import re
from datetime import timedelta

from .errors import RESTART_HINT, DistributedError

_KEY = "nbtrain/recovery/{generation}/abort"


def recover_group(cluster, timeout_s: float = 120.0) -> int | None:
    """A fresh process group on every rank (collective on the ranks).

    Returns:
        The rank that failed first (whose failure aborted the others), if a rank did.

    Raises:
        DistributedError: the ranks could not rebuild the group.
    """
    if cluster.world_size < 2:
        return None
    from . import engine_boot

    view = cluster.client.direct_view([cluster.engine_id(r) for r in range(cluster.world_size)])
    try:
        results = view.apply_async(engine_boot.rebuild).get(timeout=timeout_s)
    except Exception as exc:  # whatever went wrong, the group is unusable
        raise DistributedError(
            f"the process group could not be re-established after the "
            f"failure ({type(exc).__name__}: {exc}). {RESTART_HINT}"
        ) from None
    if any(r is None for r in results):  # ranks without recovery (a world of one)
        return None
    cluster.recovery_generation += 1
    for r in results:
        match = re.match(r"rank (\d+):", r.get("origin") or "")
        if match:
            return int(match.group(1))
    return None


def abort_from_notebook(cluster, reason: str) -> bool:
    """Abort every rank's collectives through the rendezvous store. Returns False if
    the store could not be reached (then only a restart frees a blocked rank)."""
    if cluster.world_size < 2 or getattr(cluster, "master_port", None) is None:
        return False
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            cluster.master_addr,
            int(cluster.master_port),
            is_master=False,
            timeout=timedelta(seconds=5),
            wait_for_workers=False,
        )
        store.compare_set(
            _KEY.format(generation=cluster.recovery_generation), "", f"the notebook: {reason}"
        )
        return True
    except Exception:  # the store's host (rank 0) may be gone
        return False
