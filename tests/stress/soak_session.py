"""An hours-long notebook session in minutes: training cells, killed ranks, interrupts, restarts.

    python tests/stress/soak_session.py [--cells 500] [--failures 20] [--interrupts 10]
                                        [--restarts 5] [--ranks 3] [--seed 0]
                                        [--steps 4] [--pause-s 0.05] [--every 50]

Drives a real IPython kernel (jupyter_client, as Jupyter does) that loads nbtrain,
starts `--ranks` CPU ranks, shows the dashboard, builds a small GPT and runs
`--cells` `%%distributed` training cells, each a few optimizer steps and a
checkpoint. At random cells (seeded) it injects (a cell that carries an injection
sleeps `--pause-s` after each step, the window the injection aims at; the others
train without a pause):

- rank failures: SIGKILL of one engine by its pid while a cell runs. Recovery, as
  the error message says: `%nbtrain restart`, rebuild the model, reload the last
  checkpoint, run the failed cell again;
- interrupts: the kernel's interrupt (Jupyter's stop button) while a cell runs.
  Recovery: none needed when the training loop stopped at a step boundary; when
  the cell failed, reload the checkpoint (the step may have been cut half way) and
  run the cell again. Either way a cell then checks that every rank still holds a
  variable set before the interrupt (namespaces kept) and that an all_reduce works;
- restarts: `%nbtrain restart` between cells, then rebuild and reload.

The time to recover runs from the injection to the end of the first cell that
shows the ranks ready again. It prints a progress line every `--every` cells and
at the end: kernel, engine and controller RSS after warm-up and at the end, the
time of the training cells that carried no injection (median and longest) and
of the dashboard's pictures (drawn in the kernel's background), the longest time
to recover, cells lost (a cell that never completed on every rank,
or that a rank's own record of cells run does not list), namespaces kept, and
processes left over once `%nbtrain stop` and the kernel's shutdown are done
(every process the cluster started and every descendant of the kernel, by pid and
creation time). Exit status 1 if a must-be-zero figure is not zero.
The script runs the nbtrain of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MiB = 2**20
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SETUP = """%%distributed
import json, os, time, torch
from nbtrain.models import GPT, GPTConfig
CKPT = {ckpt!r}
torch.manual_seed(0)
model = nbt.wrap(GPT(GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=16)))
opt = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
manager = nbt.optim.OptimManager()
manager.add_optimizer(opt)
step = nbt.load_checkpoint(CKPT, model, manager)["step"] if os.path.exists(
    os.path.join(CKPT, "meta.json")) else 0
kept, ran = 1000 + nbt.rank(), []

def train(steps, pause_s):
    global step
    for _ in nbt.progress(range(steps), print_s=3600):
        data = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(
            step * nbt.world_size() + nbt.rank()))
        manager.zero_grad()
        loss = model.loss(data, data.roll(1, dims=1))
        manager.backward(loss)
        manager.step()
        nbt.telemetry.metric(loss=loss)
        step += 1
        time.sleep(pause_s)
print("ready at step", step, flush=True)
"""
TRAIN = """%%distributed
print("cell {i} start", flush=True)
train({steps}, {pause_s})
nbt.save_checkpoint(CKPT, model, manager, step=step)
ran.append({i})
print("cell {i} done", step, flush=True)
"""
RELOAD = """%%distributed
step = nbt.load_checkpoint(CKPT, model, manager)["step"]
print("ready at step", step, flush=True)
"""
CHECK = """%%distributed
x = torch.ones(1)
torch.distributed.all_reduce(x)
print("check", int(x.item()), kept, json.dumps(ran), flush=True)
"""
PROCS = """import json, nbtrain.notebook.magics as _m
_c = _m.current_cluster()
print("PROCS", json.dumps({"cluster": _c.pids(), "engines": [r["pid"] for r in _c.ranks]}))
"""
CONTAINERS = """import ipywidgets.widgets.widget as _w, nbtrain.notebook.magics as _m
_k = _m.current_cluster().client
print("CONTAINERS", json.dumps({"history": len(_k.history), "results": len(_k.results),
      "metadata": len(_k.metadata), "futures": len(_k._futures),
      "outstanding": len(_k.outstanding), "digests": len(_k.session.digest_history),
      "widgets": len(_w._instances), "In": len(In)}))
"""
DRAWS = """import json, nbtrain.notebook.dashboard as _d
print("DRAWS", json.dumps(list(_d.current().draw_seconds)))
"""


class Kernel:
    """A real IPython kernel and a client to it (what Jupyter's front end does)."""

    def __init__(self, home: str, cwd: str):
        from jupyter_client import KernelManager

        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
        )
        for var in (
            "IPYTHONDIR",
            "JUPYTER_RUNTIME_DIR",
            "JUPYTER_DATA_DIR",
            "JUPYTER_CONFIG_DIR",
            "MPLCONFIGDIR",
        ):
            env[var] = os.path.join(home, var.lower())
            os.makedirs(env[var], exist_ok=True)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=cwd)
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout_s: float = 600.0, during=None) -> tuple[bool, str]:
        """Execute `code`; (ok, its text output). `during(text)` is called while it runs."""
        msg_id = self.kc.execute(code)
        parts, ok, deadline = [], True, time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cell did not finish in {timeout_s:g} s:\n{code}\n" + "".join(parts)[-3000:]
                )
            if during is not None:
                during("".join(parts))
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind == "error":
                ok = False
                parts.append(
                    f"{content['ename']}: {content['evalue']}\n"
                    + "\n".join(content["traceback"])
                    + "\n"
                )
            elif kind == "status" and content["execution_state"] == "idle":
                break
        return ok, ANSI.sub("", "".join(parts))

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def rss_mib(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / MiB
    except psutil.Error:
        return None


def identity(pid: int):
    """(pid, creation time), so a reused pid is not taken for the same process."""
    import psutil

    try:
        return (pid, psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def survivors(procs: set, timeout_s: float = 20.0) -> list[int]:
    """The processes of `procs` (pid, creation time) still running after `timeout_s`."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid, created in procs:
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return sorted(alive)
        time.sleep(0.25)


class Soak:
    """One session: the kernel, the schedule of injections and the figures."""

    def __init__(self, args, work: str):
        self.args, self.work = args, work
        self.ckpt = os.path.join(work, "ckpt")
        self.kernel = Kernel(os.path.join(work, "home"), work)
        # (pid, created) of the kernel and of every process seen under it
        self.procs: set = {identity(self.kernel.pid)} - {None}
        self.engines: list[int] = []
        self.controller: int | None = None
        self.recoveries: list[tuple[float, str, int]] = []  # (seconds, kind, cell)
        self.done: set[int] = set()  # cells that completed on every rank
        self.gen_done: list[int] = []  # ... since the ranks last started
        self.lost: list[str] = []
        self.kept = 0
        self.injected = {"kill": 0, "interrupt": 0, "restart": 0}
        self.kernel_rss: dict[str, float] = {}
        self.controller_warmup: float | None = None
        self.gens: list[dict] = []  # per set of engines: cells, first and last RSS sample
        self.containers: list[str] = []
        self.cell_s: list[float] = []  # training cells without an injection, first try
        self.draw_s: list[float] = []  # the dashboard's last 100 pictures

    # -- plumbing -----------------------------------------------------------------
    def local(self, code: str, timeout_s: float = 300.0) -> str:
        ok, text = self.kernel.run(code, timeout_s)
        if not ok:
            raise RuntimeError(f"a notebook cell failed:\n{code}\n{text}")
        return text

    def record_processes(self) -> None:
        import psutil

        text = self.local(PROCS)
        info = json.loads(text.split("PROCS", 1)[1])
        self.engines = info["engines"]
        pids = set(info["cluster"])
        try:
            pids |= {p.pid for p in psutil.Process(self.kernel.pid).children(recursive=True)}
        except psutil.Error:
            pass
        for pid in pids:
            ident = identity(pid)
            if ident is not None:
                self.procs.add(ident)
                if pid in info["cluster"] and "ipyparallel.controller" in " ".join(
                    psutil.Process(pid).cmdline()
                ):
                    self.controller = pid
        self.gens.append({"cells": 0, "first": None, "last": None})
        self.gen_done = []

    def setup(self) -> None:
        ok, text = self.kernel.run(SETUP.format(ckpt=self.ckpt))
        if not ok or text.count("ready at step") != self.args.ranks:
            raise RuntimeError(f"the model could not be set up:\n{text}")

    def restart(self) -> None:
        self.local("%nbtrain restart")
        self.record_processes()
        self.setup()

    def check_generation(self) -> None:
        """Every rank's own list of cells run since it started is the driver's list."""
        ok, text = self.kernel.run(CHECK)
        rows = re.findall(r"\[rank (\d+)\] check (\d+) (\d+) (\[.*\])", text)
        if not ok or len(rows) != self.args.ranks:
            self.lost.append(f"the check after cell {max(self.done, default=-1)} failed:\n{text}")
            return
        for rank, total, kept, ran in rows:
            missing = set(self.gen_done) - set(json.loads(ran))
            if missing or int(total) != self.args.ranks or int(kept) != 1000 + int(rank):
                self.lost.append(
                    f"rank {rank} lacks cells {sorted(missing)} (all_reduce {total}, kept {kept})"
                )

    def sample(self, cell: int) -> None:
        engines = [rss_mib(p) for p in self.engines]
        gen = self.gens[-1]
        gen["cells"] += 1
        if None not in engines and gen["cells"] >= 2:
            gen["first"] = gen["first"] or engines
            gen["last"] = engines
        rss = rss_mib(self.kernel.pid)
        if cell == self.args.warmup:
            self.kernel_rss["warmup"] = rss
            self.controller_warmup = rss_mib(self.controller) if self.controller else None
        self.kernel_rss["end"] = rss

    # -- one training cell, with its injection ------------------------------------
    def attempt(self, i: int, event: str | None, rng: random.Random):
        """Run training cell `i` once, injecting `event` a random time after it starts.

        Returns (complete, text, when the injection fired or None, the cell's seconds).
        """
        # Only a cell that carries an injection pauses between steps: the others would
        # only add sleep to the session.
        pause_s = self.args.pause_s if event in ("kill", "interrupt") else 0.0
        code = TRAIN.format(i=i, steps=self.args.steps, pause_s=pause_s)
        state = {"t": None, "fired": None}
        delay, victim = rng.uniform(0.0, 2 * self.args.pause_s), rng.randrange(self.args.ranks)
        t0 = time.monotonic()

        def inject(text):
            if event not in ("kill", "interrupt") or state["fired"]:
                return
            if state["t"] is None and f"cell {i} start" in text:
                state["t"] = time.monotonic()
            if state["t"] is not None and time.monotonic() >= state["t"] + delay:
                state["fired"] = time.monotonic()
                if event == "kill":
                    os.kill(self.engines[victim], 9)
                else:
                    self.kernel.interrupt()

        ok, text = self.kernel.run(code, during=inject)
        seconds = time.monotonic() - t0
        complete = ok and all(f"[rank {r}] cell {i} done" in text for r in range(self.args.ranks))
        if complete:
            self.done.add(i)
            self.gen_done.append(i)
            self.sample(i)
        if event == "kill" and state["fired"] is None:
            os.kill(self.engines[victim], 9)  # the cell ended first: between cells
            state["fired"] = time.monotonic()
        return complete, text, state["fired"], seconds

    def train_cell(self, i: int, event: str | None, rng: random.Random) -> str:
        """Run cell `i` (again after an injected failure) until it completes.

        Returns "missed" if an interrupt came too late to hit the cell, else "".
        """
        for attempt in range(3):
            complete, text, fired, seconds = self.attempt(i, event if attempt == 0 else None, rng)
            if attempt == 0 and event is None and complete:
                # What a user waits for per cell: held by the dashboard's last picture, a
                # cell took seconds instead of a fraction of one (test_soak_short.py).
                self.cell_s.append(seconds)
            if attempt == 0 and event == "kill":
                self.injected["kill"] += 1
                if complete:  # the rank died after the cell: the next cell meets it
                    ok, text = self.kernel.run(CHECK)
                    if ok or "died" not in text:
                        self.lost.append(f"cell {i}: a dead rank went unnoticed:\n{text}")
                elif "died" not in text:
                    self.lost.append(f"cell {i}: the killed rank was not named:\n{text}")
                self.restart()  # what the error says to do
                self.recoveries.append((time.monotonic() - fired, "rank failure", i))
            elif attempt == 0 and event == "interrupt":
                if fired is None and complete:
                    return "missed"
                if fired is not None:
                    self.injected["interrupt"] += 1
                    if not complete:
                        self.local(RELOAD)  # the step may have been cut half way
                    self.check_namespace(fired, i)
            if complete:
                return ""
            if fired is None:
                self.lost.append(f"cell {i} failed with no injected cause:\n{text}")
                self.restart()
                return ""
        self.lost.append(f"cell {i} never completed")
        return ""

    def check_namespace(self, fired: float, i: int) -> None:
        ok, text = self.kernel.run(CHECK)
        rows = re.findall(r"\[rank (\d+)\] check (\d+) (\d+) ", text)
        if (
            ok
            and len(rows) == self.args.ranks
            and all(
                int(kept) == 1000 + int(r) and int(total) == self.args.ranks
                for r, total, kept in rows
            )
        ):
            self.kept += 1
        else:
            print(f"namespace not kept after the interrupt in cell {i}:\n{text}", flush=True)
        self.recoveries.append((time.monotonic() - fired, "interrupt", i))

    # -- the session --------------------------------------------------------------
    def run(self) -> None:
        args = self.args
        rng = random.Random(args.seed)
        slots = rng.sample(
            range(args.warmup + 1, args.cells), args.failures + args.interrupts + args.restarts
        )
        kinds = (
            ["kill"] * args.failures + ["interrupt"] * args.interrupts + ["restart"] * args.restarts
        )
        schedule = dict(zip(slots, kinds))
        self.local("%load_ext nbtrain")
        self.local(f"%nbtrain start -n {args.ranks} --backend gloo")
        self.local("import json\n%nbtrain dashboard")
        self.record_processes()
        self.setup()
        started, carried = time.monotonic(), []
        for i in range(args.cells):
            event = schedule.get(i) or (carried.pop(0) if carried else None)
            if event == "restart":
                self.check_generation()
                t = time.monotonic()
                self.restart()
                self.injected["restart"] += 1
                self.recoveries.append((time.monotonic() - t, "restart", i))
                event = None
            if self.train_cell(i, event, rng) == "missed":
                carried.append("interrupt")
            if (i + 1) % args.every == 0 or i + 1 == args.cells:
                self.progress(i + 1, started)
        self.check_generation()
        self.draw_s = json.loads(self.local(DRAWS).split("DRAWS", 1)[1])

    def progress(self, n: int, started: float) -> None:
        text = self.local(CONTAINERS)
        self.containers.append(text.split("CONTAINERS", 1)[1].strip())
        engines = "/".join(f"{r:.0f}" for r in (rss_mib(p) or 0 for p in self.engines))
        print(
            f"cells {n}/{self.args.cells} | {time.monotonic() - started:.0f} s | kernel "
            f"{rss_mib(self.kernel.pid):.1f} MiB | engines {engines} MiB | controller "
            f"{rss_mib(self.controller) or 0:.1f} MiB | failures {self.injected['kill']} "
            f"interrupts {self.injected['interrupt']} restarts {self.injected['restart']} | "
            f"kernel keeps {self.containers[-1]}",
            flush=True,
        )

    def finish(self) -> int:
        """Stop the cluster and the kernel, print the figures; the exit status."""
        args = self.args
        pre_stop = {"controller": rss_mib(self.controller) if self.controller else None}
        self.local("%nbtrain stop")
        self.kernel.shutdown()
        left = survivors(self.procs)
        print(
            f"\nsoak: {args.cells} cells of {args.steps} steps on {args.ranks} ranks, "
            f"seed {args.seed}"
        )
        print(
            f"injected: {self.injected['kill']} rank failures, {self.injected['interrupt']} "
            f"interrupts, {self.injected['restart']} restarts"
        )
        kw, ke = self.kernel_rss.get("warmup"), self.kernel_rss.get("end")
        print(
            f"kernel RSS: {kw:.1f} MiB after warm-up (cell {args.warmup}), {ke:.1f} MiB at "
            f"the end: {ke - kw:+.1f} MiB"
        )
        gens = [g for g in self.gens if g["first"] and g["last"]]
        if gens:
            first, last, longest = gens[0], gens[-1], max(gens, key=lambda g: g["cells"])
            print(
                f"engine RSS (max over ranks): {max(first['first']):.1f} MiB after warm-up, "
                f"{max(last['last']):.1f} MiB at the end: "
                f"{max(last['last']) - max(first['first']):+.1f} MiB"
            )
            print(
                f"engine RSS, longest-lived engines ({longest['cells']} cells): "
                + ", ".join(
                    f"{a:.1f} -> {b:.1f}" for a, b in zip(longest["first"], longest["last"])
                )
                + " MiB"
            )
        cw, ce = self.controller_warmup, pre_stop["controller"]
        if cw and ce:
            print(
                f"controller RSS: {cw:.1f} MiB after warm-up, {ce:.1f} MiB at the end: "
                f"{ce - cw:+.1f} MiB"
            )
        print(f"kernel keeps (after warm-up -> end): {self.containers[0]} -> {self.containers[-1]}")
        if self.cell_s:
            print(
                f"training cell time: median {statistics.median(self.cell_s):.2f} s, longest "
                f"{max(self.cell_s):.2f} s ({len(self.cell_s)} cells without an injection)"
            )
        if self.draw_s:
            # A cell that waits for its last picture takes longer than a picture.
            print(
                f"dashboard picture time: median {statistics.median(self.draw_s):.2f} s "
                f"({len(self.draw_s)} pictures)"
            )
        worst = max(self.recoveries, default=(0.0, "-", -1))
        by_kind = {}
        for seconds, kind, _ in self.recoveries:
            by_kind[kind] = max(by_kind.get(kind, 0.0), seconds)
        print(
            f"longest time to recover: {worst[0]:.1f} s ({worst[1]} at cell {worst[2]}); "
            + ", ".join(f"{k} {v:.1f} s" for k, v in by_kind.items())
        )
        lost = len(self.lost) + len(set(range(args.cells)) - self.done)
        print(f"cells lost: {lost}")
        for reason in self.lost:
            print("  " + reason.replace("\n", "\n    "))
        print(f"namespaces kept: {self.kept} of {self.injected['interrupt']} interrupts")
        print(
            f"processes left over: {len(left)} of {len(self.procs)} started"
            + (f" (pids {left})" if left else "")
        )
        bad = (
            lost
            or left
            or self.kept != self.injected["interrupt"]
            or self.injected
            != {"kill": args.failures, "interrupt": args.interrupts, "restart": args.restarts}
        )
        return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=500)
    parser.add_argument("--failures", type=int, default=20)
    parser.add_argument("--interrupts", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per cell")
    parser.add_argument(
        "--pause-s",
        type=float,
        default=0.05,
        help="sleep after each step of a cell that carries an injection (its window)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="cells before the RSS baseline (default cells/10, at least 5)",
    )
    parser.add_argument("--every", type=int, default=50, help="cells between progress lines")
    args = parser.parse_args(argv)
    args.warmup = max(5, args.cells // 10) if args.warmup is None else args.warmup
    events = args.failures + args.interrupts + args.restarts
    if events > args.cells - args.warmup - 1:
        parser.error(
            f"{events} events do not fit in {args.cells - args.warmup - 1} cells after warm-up"
        )
    with tempfile.TemporaryDirectory(prefix="nbtrain-soak-") as work:
        soak = Soak(args, work)
        try:
            soak.run()
        except BaseException:
            soak.kernel.shutdown()
            survivors(soak.procs)
            raise
        return soak.finish()


if __name__ == "__main__":
    sys.exit(main())
