"""How a `Cluster` comes up, after its controller starts: the ipyparallel cluster it
asks for, waiting for the engines to register, then one rank per engine (rendezvous,
torch.distributed on each). Functions of the cluster; `Cluster.start` calls them in order.
"""

from __future__ import annotations

import os
import time

from . import address, rendezvous
from . import engine_boot as _engine_boot
from . import teardown as _teardown
from .errors import DistributedError
from .launchers import engine_config, engine_launcher


def ipp_cluster(cluster, n: int):
    """The ipyparallel Cluster (controller and engine launcher) for `cluster`'s `n` ranks."""
    import ipyparallel as ipp

    kwargs = {"profile_dir": cluster.profile_dir} if cluster.profile_dir else {}
    return ipp.Cluster(
        n=n,
        engines=engine_launcher(cluster.launcher),
        controller_ip=cluster.controller_ip,
        cluster_id=f"nbtrain-{os.getpid()}-{int(time.time() * 1000) % 10**8}",
        engine_timeout=int(cluster.start_timeout_s),
        log_level=40,
        # The hub's default in-memory store keeps the last 1024 requests (up to 1 GB)
        # with their output and published telemetry: the controller grew 35 KB per
        # 3-rank training cell of tests/stress/soak_session.py, and a cell that prints
        # much keeps much. nbtrain never reads results back from the hub.
        # The hub finishes an engine's registration at its next heartbeat: at the
        # default 3 s period a start waited 3 s more than the engines took. Beats
        # every 0.5 s, and 60 missed beats (30 s, the default's 10 x 3 s) before an
        # engine counts as gone, so a loaded machine is judged as before.
        controller_args=[
            "--nodb",
            "--HeartMonitor.period=500",
            "--HeartMonitor.max_heartmonitor_misses=60",
        ],
        config=engine_config(cluster.launcher, cluster.slurm, cluster.mpi_args),
        **kwargs,
    )


def wait_for_engines(cluster, n: int) -> None:
    """Wait up to the start timeout for `n` engines; a Slurm job that ends fails at once."""
    # A text bar (stdout, one line redrawn): ipyparallel's widget bar was 11 widgets
    # that the notebook kept for the session, every start and restart.
    future = cluster.client.wait_for_engines(
        n, block=False, timeout=cluster.start_timeout_s, widget=False
    )
    while True:
        try:
            return future.result(timeout=1.0)
        except TimeoutError:
            if future.done():
                break
        except Exception as err:  # ipyparallel's EngineError: the launcher exited
            tail = launcher_output(cluster)
            raise DistributedError(
                f"the engines' {cluster.launcher} launcher ended before {n} engines "
                f"registered ({err})" + (f"; its output ends with:\n{tail}" if tail else "")
            ) from None
        if cluster.job is not None and not cluster.job.running(max_age_s=0):
            raise cluster.job.ended_error("before all its engines registered")
    tail = cluster.job.output_tail() if cluster.job is not None else ""
    raise DistributedError(
        f"expected {n} engines, {len(cluster.client.ids)} registered within "
        f"{cluster.start_timeout_s:g} s"
        + (f"; the job's output ends with:\n{tail}" if tail else "")
    )


def launcher_output(cluster, lines: int = 60) -> str:
    """The last lines the engines' launcher (mpiexec, ...) printed."""
    out = []
    for launcher in cluster._ipp.engines.values():
        try:
            out += launcher.get_output(remove=False).splitlines()
        except OSError:
            pass
    return "\n".join(out[-lines:])


def record_launcher_processes(cluster) -> None:
    """Watch the pids of the controller and engine launchers (the watchdog ends them)."""
    launchers = [cluster._ipp.controller] + list(cluster._ipp.engines.values())
    for launcher in launchers:
        for sub in [launcher] + list(getattr(launcher, "launchers", {}).values()):
            process = getattr(sub, "process", None)
            if process is not None:
                cluster._watchdog.watch_launcher(process.pid)


def boot(cluster, n: int) -> None:
    """Number the registered engines as ranks, pick the rendezvous address and port,
    and initialise torch.distributed on every rank."""
    view = cluster.client[:]
    infos = answers(cluster, view.apply_async(_engine_boot.probe), "answer")
    cluster.ranks = rendezvous.assign_ranks(infos)
    if len(cluster.ranks) != n:
        raise DistributedError(f"expected {n} engines, {len(cluster.ranks)} registered")
    here = address.machine_id()
    for info in cluster.ranks:
        info["local"] = info.get("machine") == here  # its pid can be checked from here
        if info["local"]:
            cluster._watchdog.watch(info["pid"])
    cluster._nannies = _teardown.nannies_of(i["pid"] for i in cluster.ranks if i["local"])
    master_addr = rendezvous.master_address(cluster.ranks, cluster.master_addr_override)
    rank0 = cluster.client[cluster.ranks[0]["engine_id"]]
    try:
        master_port = rank0.apply_sync(_engine_boot.free_port, master_addr)
    except Exception as err:  # an ipyparallel RemoteError wraps the OSError
        raise DistributedError(
            f"rank 0 (on {cluster.ranks[0]['host']}) cannot listen on "
            f"{master_addr} ({err}): the rendezvous address must be one "
            "of rank 0's host (--master-addr)"
        ) from None
    envs = rendezvous.rank_envs(cluster.ranks, master_addr, master_port)
    cluster.master_addr, cluster.master_port = master_addr, master_port
    cluster.recovery_generation = 0  # fresh ranks: a fresh process group
    result = view.apply_async(
        _engine_boot.boot, envs, cluster.backend, cluster.pg_timeout_s, cluster.tp_size
    )
    for info, booted in zip(
        sorted(cluster.ranks, key=lambda i: i["engine_id"]),
        answers(cluster, result, "join the process group"),
    ):
        info["device"] = booted["device"]


def answers(cluster, result, what: str) -> list:
    """`result`'s values within the start timeout, or an error naming who is late."""
    try:
        return result.get(timeout=cluster.start_timeout_s)
    except TimeoutError:
        n = len(result.msg_ids)
        raise DistributedError(
            f"{n - result.progress} of {n} engines registered but did not {what} "
            f"within the start timeout ({cluster.start_timeout_s:g} s): their first task "
            "imports torch, which takes long on a loaded machine; give more time "
            "with --start-timeout-s (Cluster(start_timeout_s=...))"
        ) from None
