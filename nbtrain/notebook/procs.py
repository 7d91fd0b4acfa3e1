"""Process checks by PID for the notebook side of the cluster (liveness, memory)."""

from __future__ import annotations

import psutil


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def rss_bytes(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return None
