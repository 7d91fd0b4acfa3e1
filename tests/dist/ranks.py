"""run_ranks: run a function on N real gloo ranks (separate processes) and collect results.

Processes come from a forkserver that has already imported torch and nbtrain, so
a 3-rank run starts in about a second. Ranks rendezvous through a file in a
temporary folder: nothing listens on a port.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
# torch._dynamo is imported by the first torch.optim.Optimizer (8-12 s per process
# on a loaded 2-core machine): preloading it once saves that in every run.
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "nbtrain"])


def _child(fn, rank, world_size, init_file, timeout_s, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import nbtrain

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        nbtrain.init_distributed(seed=0)
        value = fn(*args)
        buf = io.BytesIO()
        torch.save(value, buf)  # by value: the child may exit before the parent reads
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc()))
    finally:
        nbtrain.dist.shutdown()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Runs `fn(*args)` on ranks 0..world_size-1; returns results by rank.

    `fn` must be importable (a module-level function). An exception on any rank
    fails the call with that rank's traceback; ranks still running after
    `timeout_s` are killed (by their own handles, never by name).
    """
    with tempfile.TemporaryDirectory(prefix="nbtrain-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = _CTX.Queue()
        procs = [_CTX.Process(target=_child, args=(fn, r, world_size, init_file,
                                                   min(timeout_s, 60.0), args, results),
                              daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} "
                                       f"did not finish within {timeout_s} s")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if not p.is_alive() and r not in out and r not in errors]
                    if dead and all(p.exitcode not in (None, 0) for p in (procs[r] for r in dead)):
                        raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                           f"{[procs[r].exitcode for r in dead]}")
                    continue
                if status == "ok":
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors[rank] = value
            if errors:
                first = min(errors)
                raise AssertionError(f"rank(s) {sorted(errors)} raised; rank {first}:\n"
                                     f"{errors[first]}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        return [out[r] for r in range(world_size)]
