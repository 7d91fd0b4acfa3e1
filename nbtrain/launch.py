"""Run a function on N local ranks and collect what each returns.

Used by `nbtrain demo`, `nbtrain bench` and the test suite. Ranks are forked from
a forkserver that has already imported torch, FSDP2 and nbtrain, so a launch
costs about a second rather than a fresh interpreter per rank. They rendezvous
through a file in a private temporary folder (nothing listens on a port), each
has RANK, WORLD_SIZE and LOCAL_RANK set and `nbtrain.init_distributed()` done
before the function runs (nccl with CUDA, else gloo), and one compute thread.
Results travel back by value (torch.save), so a rank may exit before the parent
reads them. A rank still alive after a failure or the deadline is killed through
its own process handle, never by name.
"""

from __future__ import annotations

import gc
import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

# torch._dynamo is imported by the first torch.optim.Optimizer (8-12 s per process
# on a loaded 2-core machine); FSDP2 by the benchmark. Preloaded once, in the server.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "nbtrain")
_CTX = None
# Functions called after each run_ranks with where its wall time went, in seconds:
# {"world_size", "start" (until the last rank began), "rendezvous" (the process group
# and init_distributed), "work" (the function), "teardown" (results and exits)}.
# The test suite's timing table (tests/timing.py) listens here.
PHASE_LISTENERS: list = []


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


def default_world_size() -> int:
    """One rank per GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() or 2


def _child(fn, rank, world_size, init_file, backend, seed, pg_timeout_s, args, results):
    entered = time.time()
    # One compute thread per rank: 2 ranks on 2 cores otherwise fight gloo's
    # threads for the cores.
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    import torch.distributed as dist

    import nbtrain
    from nbtrain.comm import links
    from nbtrain.comm.context import pick_backend

    # The forkserver's imports (torch, dynamo, FSDP2: about 300k objects) live as long
    # as the rank: out of the collector's sight, each full collection (the benchmark's
    # explicit ones, Python's own) stops walking them (0.12 s each).
    gc.freeze()
    torch.set_num_threads(1)
    try:
        with links.recording():  # recovery can close the group's connections
            dist.init_process_group(
                pick_backend(backend),
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
            # init_process_group is no barrier: a rank whose function fails at once
            # would close its side of gloo's mesh while a peer still connects to it.
            dist.barrier()
        nbtrain.init_distributed(seed=seed)
        ready = time.time()
        buf = io.BytesIO()
        torch.save(fn(*args), buf)
        results.put((rank, "ok", buf.getvalue(), (entered, ready, time.time())))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc(), (entered, entered, time.time())))
    finally:
        # Local teardown, no barrier: a rank that raised must not wait for peers
        # (its result is already on the queue). The rank then leaves through
        # os._exit, so no interpreter shutdown races the backend's threads.
        nbtrain.comm.shutdown(barrier=False)


def run_ranks(
    fn,
    world_size: int,
    *args,
    seed: int = 0,
    backend: str | None = None,
    timeout_s: float = 600.0,
    pg_timeout_s: float | None = None,
) -> list:
    """Runs `fn(*args)` on ranks 0..world_size-1; returns the results by rank.

    Args:
        fn: an importable (module-level) function.
        world_size: number of ranks, >= 1.
        seed: given to `init_distributed` on every rank.
        backend: "nccl", "gloo" or None (nccl with CUDA, else gloo).
        timeout_s: the whole run's deadline.
        pg_timeout_s: process-group timeout (default min(timeout_s, 60)): how
            long a rank waits in a collective for a peer that never comes.

    Raises:
        AssertionError: a rank raised; the message holds its traceback.
        RuntimeError / TimeoutError: a rank died, or the deadline passed.
    """
    pg_timeout_s = pg_timeout_s or min(timeout_s, 60.0)
    began, stamps = time.time(), {}
    with tempfile.TemporaryDirectory(prefix="nbtrain-ranks-") as tmp:
        procs, results = spawn_ranks(
            fn,
            world_size,
            *args,
            init_file=os.path.join(tmp, "rdv"),
            seed=seed,
            backend=backend,
            pg_timeout_s=pg_timeout_s,
        )
        try:
            return _collect(procs, results, timeout_s, stamps)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            _report_phases(world_size, began, stamps)


def _report_phases(world_size: int, began: float, stamps: dict) -> None:
    if not PHASE_LISTENERS:
        return
    end = time.time()
    entered, ready, done = (
        (max(s[i] for s in stamps.values()) if stamps else end) for i in range(3)
    )
    phases = {
        "world_size": world_size,
        "start": max(0.0, entered - began),
        "rendezvous": max(0.0, ready - max(entered, began)),
        "work": max(0.0, done - max(ready, began)),
        "teardown": max(0.0, end - max(done, began)),
    }
    for listener in PHASE_LISTENERS:
        listener(phases)


def spawn_ranks(
    fn,
    world_size: int,
    *args,
    init_file: str,
    seed: int = 0,
    backend: str | None = None,
    pg_timeout_s: float = 60.0,
):
    """Starts the ranks and returns (processes, results queue) without waiting.

    The building block of `run_ranks`, for callers that watch or end ranks
    themselves (by their process handles). Each rank puts (rank, "ok", bytes of
    torch.save(value), stamps) or (rank, "error", traceback, stamps) on the queue;
    stamps are the rank's time.time() on entry, once rendezvous and
    `init_distributed` are done, and once the function returned or raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one rank")
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, init_file, backend, seed, pg_timeout_s, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, results


ERROR_GRACE_S = 10.0  # after a rank raised, how long the others may take to report


def _collect(procs, results, timeout_s: float, stamps: dict) -> list:
    world_size = len(procs)
    out, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    while len(out) + len(errors) < world_size:
        if errors:
            # A rank raised: its peers either raise too (a deterministic error, soon)
            # or wait in a collective it never joins, until the process-group timeout.
            if time.monotonic() > min(e[1] for e in errors.values()) + ERROR_GRACE_S:
                break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"ranks {sorted(set(range(world_size)) - set(out))} "
                f"did not finish within {timeout_s} s"
            )
        try:
            rank, status, value, stamps[rank] = results.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive()
                and p.exitcode not in (None, 0)
                and r not in out
                and r not in errors
            ]
            if dead:
                raise RuntimeError(
                    f"rank(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}"
                ) from None
            continue
        if status == "ok":
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors[rank] = (value, time.monotonic())
    if errors:
        first = min(errors)
        waiting = sorted(set(range(world_size)) - set(out) - set(errors))
        still = (
            f" (rank(s) {waiting} still running {ERROR_GRACE_S:.0f} s later, ended)"
            if waiting
            else ""
        )
        raise AssertionError(
            f"rank(s) {sorted(errors)} raised{still}; rank {first}:\n{errors[first][0]}"
        )
    return [out[r] for r in range(world_size)]
