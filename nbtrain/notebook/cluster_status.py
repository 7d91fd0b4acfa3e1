"""`Cluster.status()`: one row per rank (alive, busy, memory, step, loss), from the
engines' processes, the hub's queues and each idle rank's own stats."""

from __future__ import annotations

import time

from . import engine_boot as _engine_boot
from .procs import rss_bytes


def hub_queues(cluster, settle_s: float = 1.0) -> dict:
    """The hub's queue_status. The hub counts a request done when the engine's copy
    of the reply reaches it, after the reply itself reached this client: just after
    a cell, a rank may still be counted busy (1 in 200 a cell, unloaded). While this
    client waits on nothing and the hub still counts a queue, it asks again, for up
    to `settle_s` (a queue another client filled stays, and is reported)."""
    deadline = time.monotonic() + settle_s
    while True:
        queues = cluster.client.queue_status()
        queued = any(q.get("queue", 0) for k, q in queues.items() if isinstance(q, dict))
        if not queued or cluster.client.outstanding or time.monotonic() > deadline:
            return queues
        time.sleep(0.02)


def rank_rows(cluster) -> list[dict]:
    """`Cluster.status()`'s rows, of a running cluster."""
    dead = set(cluster.dead_ranks(range(cluster.world_size)))
    queues = hub_queues(cluster) if len(dead) < cluster.world_size else {}
    # A just-submitted cell may not be queued yet: its ranks' stats would wait.
    running = set(cluster.pending.busy()) if cluster.pending is not None else set()
    rows = []
    for rank, info in enumerate(cluster.ranks):
        eid = info["engine_id"]
        busy = rank not in dead and (rank in running or queues.get(eid, {}).get("queue", 0) > 0)
        row = {
            "rank": rank,
            "engine_id": eid,
            "pid": info["pid"],
            "host": info["host"],
            "address": info.get("address"),
            "node": info.get("node"),
            "local_rank": info.get("local_rank"),
            "device": info.get("device"),
            "busy": busy,
            "alive": rank not in dead,
            "rss_bytes": None,
            "cuda_bytes": None,
            "step": None,
            "loss": None,
        }
        if rank not in dead and not busy:
            try:
                row.update(cluster.client[eid].apply_async(_engine_boot.stats).get(timeout=5))
            except Exception:  # reported as unknown rather than failing status
                pass
        elif rank not in dead and info.get("local"):
            row["rss_bytes"] = rss_bytes(info["pid"])
        rows.append(row)
    return rows
