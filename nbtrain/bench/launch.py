"""Start N local ranks for one benchmark run and collect their results.

Ranks are forked from a forkserver that has already imported torch, FSDP2 and
nbtrain, so a launch costs about a second instead of a fresh interpreter each.
They rendezvous through a file in a temporary folder (no listening port), and a
rank still alive after the run is killed through its own process handle.
"""
from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback

import torch.multiprocessing as mp

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.fsdp", "nbtrain",
                                     "nbtrain.bench.worker"])
    return _CTX


def _child(rank: int, world_size: int, init_file: str, spec: dict, results) -> None:
    # One compute thread per rank: 2 ranks on 2 cores otherwise fight gloo's
    # threads for the cores (see ENGINE_NOTES).
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        from .worker import run_rank

        results.put((rank, "ok", run_rank(spec, rank, world_size, init_file)))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc()))


def launch(spec: dict, world_size: int, timeout_s: float = 600.0) -> list[dict]:
    """Runs one engine on ranks 0..world_size-1; returns each rank's result dict.

    Raises RuntimeError with the first failing rank's traceback.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(r, world_size, init_file, spec, results),
                             daemon=True) for r in range(world_size)]
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for p in procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        out, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{spec['engine']}: ranks did not finish in {timeout_s} s")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive()
                            and p.exitcode not in (None, 0) and r not in out]
                    if dead:
                        raise RuntimeError(f"{spec['engine']}: rank(s) {dead} died "
                                           f"(exit codes {[procs[r].exitcode for r in dead]})")
                    continue
                (out if status == "ok" else errors)[rank] = value
            if errors:
                first = min(errors)
                raise RuntimeError(f"{spec['engine']}: rank {first} raised:\n{errors[first]}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        return [out[r] for r in range(world_size)]
