"""Ranks exit cleanly, with or without `destroy_process_group`: exit code 0 and no
"terminate called" on any rank.

A gloo worker thread keeps a collective's work object for a moment after the
waiting thread has moved on, and releasing it takes the GIL (the tensors' Python
objects). If the interpreter is already shutting down then, the thread is ended
with pthread_exit inside a noexcept destructor: std::terminate, SIGABRT. nbtrain
prevents it by making sure the group's threads are joined before shutdown starts:
`destroy_process_group` really frees the group (nothing pins it any more), and a
program that never calls it gets a teardown from `init_distributed`'s atexit hook.

The real race (a few runs in a hundred of a resume script) is too rare to catch in
a test; `python tests/stress/resume_exit.py` measures it. These runs make the
mechanism certain instead: after a few training steps each rank leaves with a
collective still completing (rank 1 joins it 0.3 s late) while an object's
`__del__` holds interpreter shutdown open for a second. A backend thread still
alive then takes the GIL during shutdown, and the rank aborts; without nbtrain's
teardown that happened on every run.

Run as a script (`--rank-mode`), this file is what each rank executes.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORLD = 2
HANG_S = 90  # a rank's own limit; the test waits a little longer


class _HoldShutdown:
    """Deleted while the interpreter shuts down (module globals go last): sleeping
    there, with the GIL released, is the window a late backend thread would hit."""

    def __del__(self):
        time.sleep(1.0)


def rank_main(exit_mode: str) -> None:
    # A rank still alive after this long prints every thread's stack and exits, so
    # a hang (not the abort this file is about) fails with the place it hung.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    import torch
    import torch.distributed as dist

    import nbtrain
    from nbtrain.models import GPT, GPTConfig

    torch.set_num_threads(1)
    ctx = nbtrain.init_distributed(seed=0)
    cfg = GPTConfig(vocab_size=64, hidden=16, heads=2, layers=2, seq_len=8)
    model = nbtrain.wrap(GPT(cfg), zero_level=3)
    # The first torch optimizer imports torch._dynamo, which imports
    # torch.distributed.nn.functional: what used to pin the group.
    opt = nbtrain.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = nbtrain.optim.OptimManager(loss_scale=1024)
    manager.add_optimizer(opt)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(3):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
        manager.zero_grad()
        manager.backward(model.loss(x, x))
        manager.step()
    nbtrain.synchronize()

    # A collective still completing as the rank leaves.
    t = torch.ones(1024)
    if ctx.rank == 0:
        nbtrain.comm.all_reduce(t, async_op=True, label="late")  # not waited on
    else:
        time.sleep(0.3)
        nbtrain.comm.all_reduce(t, label="late")
    del t
    globals()["_HOLD"] = _HoldShutdown()
    if exit_mode == "destroy":
        dist.destroy_process_group()
    print(f"rank {ctx.rank} reached the end", flush=True)


def _launch(exit_mode: str, tmp_path) -> list[tuple[int, str, str]]:
    """Both ranks as plain subprocesses with torchrun's variables; (rc, out, err) each.

    The rendezvous store lives in this process, as torchrun's agent keeps it: it
    holds its port from the moment it is picked (a port picked free and bound by
    rank 0 seconds later can be taken in between by another test's connection),
    and rank 0's exit does not take the store away from rank 1.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=WORLD, is_master=True, wait_for_workers=False)
    port = store.port
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    procs, files = [], []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            OMP_NUM_THREADS="1",
            PYTHONPATH=path,
        )
        out = open(tmp_path / f"{exit_mode}-{rank}.out", "w+")
        err = open(tmp_path / f"{exit_mode}-{rank}.err", "w+")
        files.append((out, err))
        procs.append(
            subprocess.Popen(
                [sys.executable, HERE, "--rank-mode", exit_mode], env=env, stdout=out, stderr=err
            )
        )
    results = []
    try:
        for p in procs:
            p.wait(timeout=HANG_S + 30)
    finally:
        del store
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def _check(exit_mode, tmp_path):
    results = _launch(exit_mode, tmp_path)
    report = "\n".join(
        f"rank {r}: exit {rc}\n--- stderr ---\n{err[-3000:]}"
        for r, (rc, _out, err) in enumerate(results)
    )
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, report
        assert "terminate called" not in err, report
        assert f"rank {rank} reached the end" in out, report


def test_exit_after_destroy_process_group(tmp_path):
    _check("destroy", tmp_path)


def test_exit_without_destroy_process_group(tmp_path):
    _check("no-destroy", tmp_path)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-mode":
        rank_main(sys.argv[2])
    else:
        sys.exit("usage: python test_clean_exit.py --rank-mode destroy|no-destroy")
