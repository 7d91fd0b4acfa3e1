"""How `Cluster.stop` ends what a cluster started, quickly and leaving nothing.

ipyparallel stops engines by signal, and each engine then runs the interpreter's
shutdown (seconds a rank, with the engine loop's and the TCPStore's errors printed as
the ranks go one by one). Idle local engines are asked to leave at once instead, and
what ipyparallel leaves running in this process (its loop thread) is ended here.
"""

from __future__ import annotations

import contextlib
import os

import psutil

from . import engine_boot
from .procs import wait_ended


def exit_engines(
    client,
    pids: dict[int, int],
    timeout_s: float,
    logs: list[str] = (),
    nannies: dict[int, list] | None = None,
) -> None:
    """Ask the engines `pids` (engine id -> pid: all the client's, idle, on this machine)
    to leave at once (engine_boot.exit_now), wait up to `timeout_s` for them, then end
    the nannies of those that left. Engines already gone (a killed rank) are skipped:
    the others still leave at once (left to ipyparallel's signal, a stop after a killed
    rank took 4.3 s instead of 0.2).

    `nannies` maps an engine's pid to its nanny processes, as found when it booted
    (`nannies_of`); without it they are looked up now, which finds none for an engine
    already gone.

    `logs`, the engines' log files (ipyparallel's launcher output), are removed first.
    JupyterLab's ipyparallel extension loads every cluster file it finds in the
    profiles, this one's too, and watches its engines; they are not its children, so
    it reads no exit code and wrote each engine's whole log as a warning into the
    server's terminal at every clean stop.

    Each engine's nanny (ipyparallel's, a child of the engine) tells the hub that its
    engine left and exits: 1-2 s of interpreter shutdown, and 3 s more (its socket's
    linger) when the hub was stopped first. The hub is being stopped, so the message is
    moot: the nannies are ended by their pid, a killed engine's at once (on a busy
    machine its nanny was still lingering when the hub stopped, and the stop waited
    for it: 4.1 s). An engine that did not leave keeps its nanny and is left to
    ipyparallel's signal.
    """
    if nannies is None:
        nannies = nannies_of(pids.values())
    living, gone = {}, []
    for engine_id, pid in pids.items():
        try:
            living[engine_id] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            gone.extend(nannies.get(pid, []))
    _kill(gone)
    wait_ended(gone, timeout_s)
    if not living:
        return
    procs = list(living.values())
    try:
        remove_logs(logs)
        client[list(living)].apply_async(engine_boot.exit_now)
    except Exception:  # gone meanwhile, or the client broke: signal them
        return
    alive = wait_ended(procs, timeout_s, reap=False)  # ipyparallel reaps its engines
    ended = [nanny for proc in procs if proc not in alive for nanny in nannies.get(proc.pid, [])]
    _kill(ended)
    wait_ended(ended, timeout_s)


def nannies_of(pids) -> dict[int, list]:
    """Each engine pid's nanny processes (ipyparallel's, children of the engine)."""
    found = {}
    for pid in pids:
        try:
            found[pid] = [c for c in psutil.Process(pid).children() if _is_nanny(c)]
        except psutil.Error:  # gone
            found[pid] = []
    return found


def _kill(procs) -> None:
    for proc in procs:
        try:
            proc.kill()  # psutil checks that the pid still names the same process
        except psutil.Error:  # gone already
            pass


def remove_logs(paths) -> None:
    """Remove these launcher log files (None and missing ones are skipped)."""
    for path in paths:
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)


def end_loop_thread(ipp_cluster, timeout_s: float) -> None:
    """End the thread in which ipyparallel ran this cluster's `*_sync` calls.

    Inside a running event loop (every Jupyter kernel) ipyparallel runs them in a
    thread of the cluster's own, with a Tornado loop that it never stops: each start
    or restart left a thread, its loop's file descriptors and the whole
    ipyparallel Cluster behind.
    """
    loop = getattr(ipp_cluster, "_thread_loop", None)
    thread = getattr(ipp_cluster, "_async_thread", None)
    if loop is None or thread is None:
        return
    loop.add_callback(loop.stop)
    thread.join(timeout_s)
    if not thread.is_alive():
        loop.close()
        ipp_cluster._async_thread = None  # a later `*_sync` call starts a fresh one


def _is_nanny(proc) -> bool:
    try:
        return "ipyparallel.engine.nanny" in proc.cmdline()
    except psutil.Error:  # gone, or not ours to read
        return False
