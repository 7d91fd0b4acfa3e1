"""Stress: does a resumed multi-rank run exit cleanly, every time?

    python tests/stress/resume_exit.py [--runs 40] [--ranks 3] [--exit both|destroy|no-destroy]

Writes a checkpoint of a small GPT once, then launches the resume script N times
under `python -m torch.distributed.run --standalone --nproc_per_node R`. Each run:
init_distributed, a sharded (ZeRO-3) model, OptimManager + AdamOptimizer,
load_checkpoint, 5 steps, a barrier, then either
`torch.distributed.destroy_process_group()` ("destroy") or a plain return from
the script with the group still alive ("no-destroy"). With `--exit both` (the
default) the runs alternate between the two.

Prints each run's per-rank exit codes and, at the end, `aborted ranks: K of M`:
a rank counts as aborted when its exit code is not 0 or its stderr holds
"terminate called". When one rank aborts, torchrun ends the others (exit -15),
so one failed run usually counts 3; the line before it counts failed runs.
Exit status is 1 when K > 0.

Not a pytest test: a teardown race shows up in a few runs out of tens, which is
too slow and too flaky for the suite (tests/multirank/test_clean_exit.py is the
quick, deterministic part). One run takes ~10 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # this checkout's nbtrain
TERMINATE = "terminate called"


# -- the script each rank runs ---------------------------------------------------------
def _build():
    import torch

    import nbtrain
    from nbtrain.models import GPT, GPTConfig

    torch.set_num_threads(1)
    nbtrain.init_distributed(seed=0)
    cfg = GPTConfig(vocab_size=257, hidden=50, heads=5, layers=3, seq_len=8)
    model = nbtrain.wrap(GPT(cfg), zero_level=3)
    opt = nbtrain.optim.AdamOptimizer(model.parameters(), lr=1e-3)
    manager = nbtrain.optim.OptimManager(loss_scale=1024)
    manager.add_optimizer(opt)
    return cfg, model, manager


def _train(cfg, model, manager, steps: int) -> None:
    import torch

    import nbtrain

    gen = torch.Generator().manual_seed(1000 + nbtrain.rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
        y = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
        manager.zero_grad()
        manager.backward(model.loss(x, y))
        manager.step()


def rank_main(mode: str, ckpt: str, steps: int) -> None:
    import torch.distributed as dist

    import nbtrain

    cfg, model, manager = _build()
    if mode == "write":
        _train(cfg, model, manager, 1)
        nbtrain.save_checkpoint(model, ckpt, manager, step=0)
        nbtrain.synchronize()
        dist.destroy_process_group()
        return
    nbtrain.load_checkpoint(model, ckpt, manager)
    _train(cfg, model, manager, steps)
    nbtrain.synchronize()
    if mode == "destroy":
        dist.destroy_process_group()
    # "no-destroy": the interpreter exits with the process group alive.


# -- the driver ------------------------------------------------------------------------
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def launch(mode: str, ranks: int, ckpt: str, log_dir: str, steps: int, timeout: float):
    """One torchrun job: (job exit code, {rank: exit code}, {rank: stderr}, torchrun output)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "--log-dir",
        log_dir,
        "--redirects",
        "2",
        HERE,
        "--rank-mode",
        mode,
        "--ckpt",
        ckpt,
        "--steps",
        str(steps),
    ]
    # Its own session, so that a run past the timeout ends with all its ranks.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        job_rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        job_rc = "timeout"
    codes = {r: 0 for r in range(ranks)} if job_rc == 0 else {}
    for rank, code in _FAILURE.findall(out):
        codes[int(rank)] = int(code)
    if job_rc != 0:
        # torchrun lists the ranks that failed; the others exited 0. A failed job
        # that lists none (a timeout, an agent error) counts every rank.
        default = 0 if codes else f"job:{job_rc}"
        for r in range(ranks):
            codes.setdefault(r, default)
    errs = {}
    for root, _dirs, files in os.walk(log_dir):
        if "stderr.log" in files:
            # torchrun's layout: <log_dir>/<run_id>/attempt_0/<local_rank>/stderr.log
            rank = int(os.path.basename(root))
            with open(os.path.join(root, "stderr.log"), errors="replace") as f:
                errs[rank] = f.read()
    return job_rc, codes, errs, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--exit",
        dest="exit_mode",
        choices=("both", "destroy", "no-destroy"),
        default="both",
        help="how each run ends (both: alternate)",
    )
    ap.add_argument("--no-destroy", action="store_true", help="same as --exit no-destroy")
    ap.add_argument("--timeout", type=float, default=180.0, help="per run, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument(
        "-v", "--verbose", action="store_true", help="print the stderr of aborted ranks"
    )
    # Set when torchrun runs this file as the per-rank script.
    ap.add_argument("--rank-mode", choices=("write", "destroy", "no-destroy"))
    ap.add_argument("--ckpt")
    args = ap.parse_args(argv)

    if args.rank_mode:
        rank_main(args.rank_mode, args.ckpt, args.steps)
        return 0

    if args.no_destroy:
        args.exit_mode = "no-destroy"
    work = tempfile.mkdtemp(prefix="nbtrain-resume-exit-")
    ckpt = os.path.join(work, "ckpt")
    try:
        rc, codes, errs, out = launch(
            "write", args.ranks, ckpt, os.path.join(work, "logs-write"), args.steps, args.timeout
        )
        if rc != 0:
            print(out[-4000:])
            for r in sorted(errs):
                print(f"--- rank {r} stderr ---\n{errs[r][-3000:]}")
            # A teardown abort after the checkpoint is complete still leaves it usable.
            if not os.path.exists(os.path.join(ckpt, "meta.json")):
                print("writing the checkpoint failed")
                return 2
            print("(the checkpoint-writing job did not exit cleanly; continuing)")
        aborted = total = failed_runs = 0
        kinds: dict = {}
        t0 = time.monotonic()
        for i in range(args.runs):
            mode = args.exit_mode
            if mode == "both":
                mode = "destroy" if i % 2 == 0 else "no-destroy"
            log_dir = os.path.join(work, f"logs-{i}")
            start = time.monotonic()
            rc, codes, errs, out = launch(mode, args.ranks, ckpt, log_dir, args.steps, args.timeout)
            bad = []
            for r in range(args.ranks):
                code, err = codes.get(r, "?"), errs.get(r, "")
                total += 1
                if code != 0 or TERMINATE in err:
                    aborted += 1
                    bad.append(r)
                    kind = f"{mode}: exit {code}" + (" + terminate" if TERMINATE in err else "")
                    kinds[kind] = kinds.get(kind, 0) + 1
            line = " ".join(f"r{r}={codes.get(r, '?')}" for r in range(args.ranks))
            failed_runs += bool(bad)
            flag = f"  ABORTED ranks {bad}" if bad else ""
            print(
                f"run {i + 1:3d}/{args.runs} {mode:10s} job={rc} {line} "
                f"({time.monotonic() - start:.1f} s){flag}",
                flush=True,
            )
            if bad and args.verbose:
                for r in bad:
                    print(f"--- run {i + 1} rank {r} stderr (tail) ---\n{errs.get(r, '')[-2000:]}")
                if not errs:
                    print(out[-3000:])
            shutil.rmtree(log_dir, ignore_errors=True)
        print(f"{args.runs} runs in {time.monotonic() - t0:.0f} s")
        for kind, n in sorted(kinds.items()):
            print(f"  {kind}: {n}")
        print(f"runs with an aborted rank: {failed_runs} of {args.runs}")
        print(f"aborted ranks: {aborted} of {total}")
        return 1 if aborted else 0
    finally:
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
