"""Functions that run inside ipyparallel engines, sent by `nbtrain.notebook.cluster`.

They are pickled by reference, so every engine imports this module: keep it free of
ipyparallel and of anything slow. Each returns plain dicts so that the client needs
nothing from the engine's Python objects.
"""

from __future__ import annotations

import os
import socket
import sys

# Launchers that give each process its rank: (rank variable, local-rank variable).
# With one of these present a rank equals its launcher rank (its MPI or Slurm rank);
# otherwise ranks follow ipyparallel engine ids.
_LAUNCHER_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "MPI_LOCALRANKID"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_LOCALID"),
)


def _engine_id() -> int:
    from IPython import get_ipython

    return get_ipython().kernel.engine_id


def probe() -> dict:
    """Identity of this engine: engine id, pids, host, address and launcher rank if any.

    `host` names the host (`NBTRAIN_HOST` overrides it), `address` is this host's address
    that the other ranks can reach (`nbtrain.notebook.address`), `machine` tells the
    notebook whether the pid can be checked from there, `node` is the Slurm node name.
    """
    from . import address

    info = {
        "engine_id": _engine_id(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "host": address.host_name(),
        "address": address.host_address(address.controller_host()),
        "machine": address.machine_id(),
        "node": os.environ.get("SLURMD_NODENAME"),
        "launcher_rank": None,
        "launcher_local_rank": None,
    }
    for rank_var, local_var in _LAUNCHER_RANK_VARS:
        if os.environ.get(rank_var, "").isdigit():
            info["launcher_rank"] = int(os.environ[rank_var])
            local = os.environ.get(local_var, "")
            info["launcher_local_rank"] = int(local) if local.isdigit() else None
            break
    return info


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that is free on `address` now (bind port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def boot(env_by_engine: dict, backend: str | None, pg_timeout_s: float, tp_size: int = 1) -> dict:
    """Set this engine's rank variables, initialise torch.distributed, fill the namespace.

    Collective: every engine of the cluster runs this at the same time.

    Returns:
        {"rank", "device"} as seen by `nbtrain.init_distributed`.
    """
    os.environ.update(env_by_engine[_engine_id()])
    import torch
    from IPython import get_ipython

    import nbtrain

    ctx = nbtrain.init_distributed(backend=backend, pg_timeout_s=pg_timeout_s, tp_size=tp_size)
    nbtrain.telemetry.publish_to_notebook()  # feeds the dashboard while cells run
    shell = get_ipython()
    shell.user_ns.update({"torch": torch, "nbt": nbtrain})
    from . import engine_post_mortem

    engine_post_mortem.watch(shell)  # keeps a failing cell's frames for `%nbtrain debug`
    from . import engine_bounds

    engine_bounds.install(shell)  # the shell's history of cells, bounded
    from nbtrain.comm import recovery

    if recovery.arm(pg_timeout_s):
        shell.set_custom_exc((BaseException,), _cell_failed)
    return {"rank": ctx.rank, "device": str(ctx.device)}


def _cell_failed(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for an exception in a cell on this engine.

    Tells the other ranks (their pending collectives fail within a second, see
    nbtrain.comm.recovery), notes on the exception why this rank stopped and whether
    a training step was cut half way, then shows the traceback as IPython would.
    The client rebuilds the process group once every rank has finished the cell.
    """
    from nbtrain.comm import recovery

    summary = f"{etype.__name__}: {value}".splitlines()[0][:200]
    phase = recovery.interrupted_phase()
    origin = recovery.fail(summary)
    stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    # The exception's own notes (e.g. the pipeline stage that raised), where IPython
    # did not show them (before 8.15 it drops __notes__).
    notes = [
        n
        for n in getattr(value, "__notes__", ()) or ()
        if isinstance(n, str) and not any(n in line for line in stb[-3:])
    ]
    who, _, why = (origin or "").partition(": ")
    if who.startswith("rank") and who != f"rank {recovery.rank()}":
        notes.append(
            f"nbtrain: this rank stopped because {who} failed ({why}); "
            "its collectives were aborted."
        )
    elif who == "the notebook":
        notes.append(f"nbtrain: the notebook aborted this rank's collectives ({why}).")
    if phase is not None:
        notes.append(
            f"nbtrain: the step was interrupted half way, during {phase}: "
            "parameters or optimizer state may be partly updated. Reload a "
            "checkpoint (nbtrain.load_checkpoint) before training on."
        )
    # What showtraceback does, with the notes appended.
    shell._showtraceback(etype, value, stb + notes)
    return None


def rebuild() -> dict:
    """After a failed cell: a fresh process group on every rank (collective).

    Returns:
        {"origin": "rank R: summary" of the rank that failed first, or None;
         "phase": the step phase a failure cut through, or None}.
    """
    from nbtrain.comm import recovery

    from . import engine_post_mortem

    origin, phase = recovery.failed_first(), recovery.interrupted_phase()
    recovery.rebuild()
    engine_post_mortem.release_aborted_groups()  # their gloo threads and sockets
    return {"origin": origin, "phase": phase}


def stats() -> dict:
    """This engine's memory and progress.

    Returns:
        rss_bytes, cuda_bytes (0 without CUDA), step (the telemetry step counter)
        and loss (the newest `loss` metric recorded, or None).
    """
    import sys

    import psutil

    info = {
        "rss_bytes": psutil.Process().memory_info().rss,
        "cuda_bytes": 0,
        "step": None,
        "loss": None,
    }
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            info["cuda_bytes"] = torch.cuda.memory_allocated()
    except ImportError:
        pass
    telemetry = sys.modules.get("nbtrain.telemetry")
    if telemetry is not None:
        info["step"] = telemetry.RECORDER.step
        info["loss"] = telemetry.RECORDER.last_metric("loss")
    return info


def shutdown() -> None:
    """Destroy the process group before the engine exits (frees the rendezvous port)."""
    try:
        from nbtrain.comm import shutdown as dist_shutdown

        dist_shutdown(barrier=False)  # engines stop one by one: no rank waits for another
    except Exception:  # the engine is going away; a broken group must not block that
        pass


def exit_now() -> None:
    """End this engine at once (Cluster.stop): destroy the process group here, then
    leave through os._exit. Under ipyparallel's stop signal an engine instead runs the
    interpreter's shutdown, which takes seconds a rank and prints the engine loop's and
    the TCPStore's errors as the ranks go one by one."""
    shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not keep the engine alive
            pass
    os._exit(0)
