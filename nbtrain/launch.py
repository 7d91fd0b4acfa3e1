"""Run a function on N local ranks, as torchrun would, from Python.

Used by `nbtrain demo` and `nbtrain bench`. Each rank is a fresh process (spawn)
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT
in its environment, so `init_distributed()` inside it behaves exactly as under
torchrun. The rendezvous listens on loopback only.
"""
from __future__ import annotations

import os
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_world_size() -> int:
    """One rank per GPU, else 2 CPU ranks."""
    import torch

    return torch.cuda.device_count() or 2


def _entry(rank, fn, world_size, port, args, errors):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        import nbtrain

        nbtrain.dist.shutdown()


def run_local(fn, world_size: int, *args) -> None:
    """Runs `fn(*args)` on `world_size` local ranks; raises if any rank fails.

    `fn` must be importable (module level). On failure every rank is ended by
    its own process handle.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one rank")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, args, errors),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive() and any(q.exitcode not in (None, 0) for q in procs):
                p.kill()
            p.join()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        detail = errors.get()[1] if not errors.empty() else ""
        raise RuntimeError(f"rank(s) {[r for r, _ in failed]} failed "
                           f"(exit codes {[c for _, c in failed]})\n{detail}")
