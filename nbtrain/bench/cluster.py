"""How much the interactive cluster costs over bare ipyparallel, measured in one run.

    python -m nbtrain.bench.cluster [--ranks 2] [--cells 30]

1. Start: `%nbtrain start -n N` until ready, against a bare
   `ipp.Cluster(n=N).start_and_connect_sync()` plus the same torch work on every
   engine (import torch, init the gloo group). Goal: within 2 s of the bare path.
2. Empty cell (body `pass`; IPython refuses a truly empty cell magic): `%%distributed`
   against ipyparallel's own `%%px` on the same engines, median over interleaved runs.
   Goal: at most 1.2x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

_TORCH_INIT = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                  WORLD_SIZE=str(world))
dist.init_process_group("gloo", rank=rank, world_size=world)
"""


def bare_start_s(n: int) -> float:
    """Seconds for bare ipyparallel to start N engines with gloo initialised."""
    import ipyparallel as ipp

    from ..notebook.engine_boot import free_port

    tic = time.perf_counter()
    cluster = ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=40)
    client = cluster.start_and_connect_sync()
    port = free_port()
    view = client[:]
    view.scatter("rank", list(range(n)), flatten=True, block=True)
    view.push({"port": port, "world": n}, block=True)
    view.execute(_TORCH_INIT, block=True)
    elapsed = time.perf_counter() - tic
    client.close()
    cluster.stop_cluster_sync()
    return elapsed


def nbtrain_start_s(shell, n: int) -> float:
    """Seconds from `%nbtrain start -n N` to ready (torch.distributed up on every rank)."""
    from IPython.utils.capture import capture_output

    tic = time.perf_counter()
    with capture_output():
        shell.run_line_magic("nbtrain", f"start -n {n}")
    return time.perf_counter() - tic


def empty_cell_s(shell, cells: int) -> tuple[float, float]:
    """Median seconds of an empty `%%distributed` and an empty `%%px` cell."""
    from IPython.utils.capture import capture_output

    from ..notebook.magics import current_cluster

    view = current_cluster().client[:]
    view.block = True  # %%px waits for the engines, as %%distributed does
    view.activate()  # registers %%px on the same engines
    ours, theirs = [], []
    with capture_output():
        for _ in range(3):  # warm both paths
            shell.run_cell_magic("distributed", "", "pass")
            shell.run_cell_magic("px", "", "pass")
        for _ in range(cells):
            for magic, times in (("distributed", ours), ("px", theirs)):
                tic = time.perf_counter()
                shell.run_cell_magic(magic, "", "pass")
                times.append(time.perf_counter() - tic)
    return statistics.median(ours), statistics.median(theirs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cells", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="nbtrain-bench-"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbtrain")
    bare = bare_start_s(args.ranks)
    ours = nbtrain_start_s(shell, args.ranks)
    try:
        cell_ours, cell_px = empty_cell_s(shell, args.cells)
    finally:
        shell.run_line_magic("nbtrain", "stop")
    result = {
        "ranks": args.ranks,
        "bare_start_s": bare,
        "nbtrain_start_s": ours,
        "start_gap_s": ours - bare,
        "empty_cell_ms": cell_ours * 1e3,
        "empty_px_ms": cell_px * 1e3,
        "cell_ratio": cell_ours / cell_px,
    }
    print(
        f"start, {args.ranks} ranks:  bare ipyparallel + torch init {bare:6.2f} s   "
        f"%nbtrain start {ours:6.2f} s   gap {ours - bare:+.2f} s  (goal: <= +2 s)"
    )
    print(
        f"empty cell (median of {args.cells}):  %%px {cell_px * 1e3:6.2f} ms   "
        f"%%distributed {cell_ours * 1e3:6.2f} ms   ratio {cell_ours / cell_px:.2f}x  "
        f"(goal: <= 1.2x)"
    )
    return result


if __name__ == "__main__":
    main()
