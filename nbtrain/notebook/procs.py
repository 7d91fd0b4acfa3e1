"""Process checks by PID for the notebook side of the cluster (liveness, memory)."""

from __future__ import annotations

import os
import time

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


def wait_ended(procs: list, timeout_s: float, reap: bool = True) -> list:
    """Waits up to `timeout_s` for each of `procs` (psutil.Process) to exit; returns
    those still running.

    A zombie that is not this process's child counts as ended: it runs nothing, and
    only its parent can reap it. An orphan's parent is init, and a container's init
    may take a second or more to reap (1.3 s measured); psutil.wait_procs waits for
    that. This process's own children are reaped here, as wait_procs does, unless
    `reap` is False: then a child that exited counts as ended and stays a zombie for
    the code that started it (ipyparallel's launcher reads each engine's exit code;
    an engine reaped here had "exit code None", and the launcher wrote the engine's
    whole log as a warning into the Jupyter server's terminal at every clean stop).
    """
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        if reap:
            _, alive = psutil.wait_procs(alive, timeout=0)
            alive = [proc for proc in alive if not _foreign_zombie(proc)]
        else:
            alive = [proc for proc in alive if not _exited(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _exited(proc) -> bool:
    try:
        return proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _foreign_zombie(proc) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid()
    except psutil.NoSuchProcess:
        return True
