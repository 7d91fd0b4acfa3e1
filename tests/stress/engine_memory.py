"""Do engines that live for thousands of cells keep their memory per cell bounded?

    python tests/stress/engine_memory.py [--cells 1000] [--ranks 3] [--errors 20]
                                         [--interrupts 20] [--steps 4] [--warmup 300]
                                         [--max-engine-mib 4] [--max-kernel-mib 16]
                                         [--every 100]

Drives a real IPython kernel (jupyter_client, as Jupyter does): `%load_ext nbtrain`,
`%nbtrain start -n R`, `%nbtrain dashboard`, a small GPT (ZeRO-3, AdamOptimizer,
OptimManager), then `--cells` `%%distributed` training cells of `--steps` steps in
`nbt.progress`. Spread over them: `--errors` cells in which one rank raises in the
middle of its loop (its peers, blocked in a collective, are freed and the group is
rebuilt: what a bug in a user's cell does), and `--interrupts` cells stopped with the
kernel's interrupt (the stop button: every rank leaves its loop at one step). The
warm-up has one of each besides: the first failure pays once for what later ones
reuse (~19 MiB an engine: the traceback formatter's imports and caches, the
post-mortem of the last failure).

After `--warmup` cells (default: until the bounded buffers are full, the step history's
1000 rows a rank, 300 cells of 4 steps) it takes each engine's and the kernel's RSS as the baseline, and
the bytes of each part that keeps something per cell (the IPython shell's input history,
output cache, history database and cells in linecache, the kernel session's message
digests, the traceback formatter's source caches, nbtrain's telemetry; in the kernel
also the ipyparallel client's records, the widgets and the dashboard). At the end it
prints each RSS's growth since, per cell, and each part's bytes then and now. Exit
status 1 when an engine grew more than `--max-engine-mib` or the kernel more than
`--max-kernel-mib`, when a cell failed that should not have, or a process is left over.

The script runs the nbtrain of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Run by path, this folder is first on the search path: the soak's kernel driver.
from soak_session import PROCS, Kernel, identity, rss_mib, survivors

from nbtrain.telemetry.steplog import DEFAULT_HISTORY

# The model every cell trains (restart_memory.py builds it too).
MODEL = """import time, torch
from nbtrain.models import GPT, GPTConfig
torch.manual_seed(0)
model = nbt.wrap(GPT(GPTConfig(vocab_size=64, hidden=32, heads=2, layers=2, seq_len=16)),
                 zero_level=3)
opt = nbt.optim.AdamOptimizer(model.parameters(), lr=1e-3)
manager = nbt.optim.OptimManager(loss_scale=None)
manager.add_optimizer(opt)
"""
SETUP = (
    "%%distributed\n"
    + MODEL
    + """step = 0

def train(steps, fail_on=None, pause_s=0.0):
    global step
    for n in nbt.progress(range(steps), desc="train"):
        if n == 2 and nbt.rank() == fail_on:
            raise ValueError(f"a bug in this cell, on rank {fail_on}")
        data = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        manager.zero_grad()
        loss = model.loss(data, data.roll(1, dims=1))
        manager.backward(loss)
        manager.step()
        step += 1
        time.sleep(pause_s)
print("ready", flush=True)
"""
)
TRAIN = """%%distributed
print("cell {i} start", flush=True)
train({steps}, fail_on={fail_on}, pause_s={pause_s})
print("cell {i} done", step, flush=True)
"""
# The bytes reachable from a part's roots: sys.getsizeof over the objects they refer to
# (modules, classes, functions, frames and code not followed).
BYTES = """import gc as _gc, sys as _sys, types as _types, json as _json, linecache as _lc
def _bytes(*roots):
    seen, total, stack = set(), 0, list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, _types.ModuleType, _types.FunctionType,
                                           _types.FrameType, _types.CodeType)):
            continue
        seen.add(id(o))
        total += _sys.getsizeof(o)
        stack.extend(_gc.get_referents(o))
    return total
def _shell_parts(ip):
    hm, ns = ip.history_manager, ip.user_ns
    cells = [k for k in _lc.cache if "ipykernel" in k or k.startswith("<ipython-input")]
    db = hm.db.execute("pragma page_count").fetchone()[0] * hm.db.execute(
        "pragma page_size").fetchone()[0] if hm.db is not None else 0
    out = {
        "input history (In, _iN)": _bytes(hm.input_hist_parsed, hm.input_hist_raw,
                                          [ns[k] for k in ns if k[:2] == "_i"]),
        "output cache (Out, _N)": _bytes(hm.output_hist, ns.get("Out")),
        "history database (engines: in memory)": db,
        "cells in linecache": _bytes([_lc.cache[k] for k in cells]),
        "message digests": _bytes(ip.kernel.session.digest_history),
    }
    try:
        import executing as _ex
        out["traceback source caches"] = _bytes(
            [v for v in vars(_ex.Source).values() if isinstance(v, dict)])
    except ImportError:
        pass
    return out
"""
# What an engine keeps per cell, by part.
PARTS = (
    "%%distributed\n"
    + BYTES
    + """
from nbtrain import telemetry as _t
_p = _shell_parts(get_ipython())
_p["telemetry raw events"] = _bytes(_t.RECORDER.events)
_p["telemetry step history"] = _bytes(_t.RECORDER.log)
_p["objects (count)"] = len(_gc.get_objects())
def _gloo_threads():
    n = 0
    for task in __import__("glob").glob("/proc/self/task/*"):
        try:
            n += "gloo" in open(task + "/comm").read()
        except OSError:  # the thread ended meanwhile
            pass
    return n
_p["gloo threads (count)"] = _gloo_threads()
print("PARTS", _json.dumps(_p), flush=True)
"""
)
# What the notebook's kernel keeps per cell.
KERNEL_PARTS = (
    BYTES
    + """
import ipywidgets.widgets.widget as _w
from nbtrain.notebook import dashboard as _d, magics as _m
_c = _m.current_cluster().client
_p = _shell_parts(get_ipython())
_p["client records"] = _bytes(_c.history, _c.results, _c.metadata, _c._futures)
_p["client digests"] = _bytes(_c.session.digest_history)
_p["widgets (count)"] = len(_w._instances)
_p["dashboard"] = _bytes(_d.current().summaries) if _d.current() else 0
_p["objects (count)"] = len(_gc.get_objects())
print("PARTS", _json.dumps(_p), flush=True)
"""
)


class Session:
    def __init__(self, args, work: str):
        self.args = args
        self.kernel = Kernel(os.path.join(work, "home"), work)
        self.procs: set = {identity(self.kernel.pid)} - {None}
        self.engines: list[int] = []
        self.unexpected: list[str] = []
        self.parts: list[dict] = []
        self.interrupted = 0

    def local(self, code: str) -> str:
        ok, text = self.kernel.run(code)
        if not ok:
            raise RuntimeError(f"a notebook cell failed:\n{code}\n{text}")
        return text

    def record_processes(self) -> None:
        import psutil

        info = json.loads(self.local(PROCS).split("PROCS", 1)[1])
        self.engines = info["engines"]
        pids = set(info["cluster"])
        pids |= {p.pid for p in psutil.Process(self.kernel.pid).children(recursive=True)}
        self.procs |= {identity(p) for p in pids} - {None}

    def rss(self) -> dict:
        return {"kernel": rss_mib(self.kernel.pid), "engines": [rss_mib(p) for p in self.engines]}

    def probe(self) -> None:
        rows = [
            json.loads(line.split("PARTS", 1)[1])
            for line in self.local(PARTS).splitlines()
            if "PARTS" in line
        ]
        kernel = json.loads(self.local(KERNEL_PARTS).split("PARTS", 1)[1])
        self.parts.append({"rss": self.rss(), "ranks": rows, "kernel": kernel})

    def cell(self, i: int, kind: str) -> None:
        fail_on = None
        if kind.startswith("error"):  # "error" (rank i % ranks) or "error:R"
            fail_on = int(kind.split(":")[1]) if ":" in kind else i % self.args.ranks
            kind = "error"
        pause_s = 0.02 if kind == "interrupt" else 0.0
        steps = 10**6 if kind == "interrupt" else self.args.steps
        code = TRAIN.format(i=i, steps=steps, fail_on=fail_on, pause_s=pause_s)
        state = {"at": None, "sent": False}

        def interrupt(text):  # 0.3 s into the loop, as a user presses the stop button
            if kind != "interrupt" or state["sent"]:
                return
            if state["at"] is None and f"cell {i} start" in text:
                state["at"] = time.monotonic() + 0.3
            if state["at"] is not None and time.monotonic() >= state["at"]:
                self.kernel.interrupt()
                state["sent"] = True

        ok, text = self.kernel.run(code, during=interrupt)
        done = text.count(f"cell {i} done")
        if kind == "error":
            if ok or "a bug in this cell" not in text:
                self.unexpected.append(f"cell {i}: the failing rank's error not shown:\n{text}")
        elif kind == "interrupt":
            if not ok or done != self.args.ranks or "every rank stopped cleanly" not in text:
                self.unexpected.append(f"cell {i}: the stop did not end the loop:\n{text}")
            self.interrupted += 1
        elif not ok or done != self.args.ranks:
            self.unexpected.append(f"cell {i} failed:\n{text[-3000:]}")

    def run(self) -> None:
        args = self.args
        self.local("%load_ext nbtrain")
        self.local(f"%nbtrain start -n {args.ranks} --backend gloo")
        self.local("%nbtrain dashboard")
        self.record_processes()
        if "ready" not in self.local(SETUP):
            raise RuntimeError("the model was not built")
        after = range(args.warmup, args.cells)
        # The warm-up has a failing cell and a stopped one: the first of each pays for
        # what every later one reuses (the traceback formatter's imports and caches, the
        # post-mortem of the last failure, the rebuilt groups' buffers).
        # Two failures, on ranks 0 and 1: a rank pays its share once as the failing
        # rank and once as a peer aborted in a collective (formatting that error).
        kinds = {args.warmup // 4: "error:0", args.warmup // 2: "error:1"}
        kinds[3 * args.warmup // 4] = "interrupt"
        for n, kind in ((args.errors, "error"), (args.interrupts, "interrupt")):
            for j in range(n):  # evenly spread after warm-up, errors and stops apart
                at = args.warmup + (2 * j + (kind == "interrupt") + 1) * len(after) // (2 * n + 1)
                kinds[at] = kind
        started = time.monotonic()
        for i in range(args.cells):
            if i == args.warmup:
                self.probe()
            self.cell(i, kinds.get(i, "train"))
            if (i + 1) % args.every == 0 or i + 1 == args.cells:
                now = self.rss()
                engines = "/".join(f"{r:.1f}" for r in now["engines"])
                print(
                    f"cells {i + 1}/{args.cells} | {time.monotonic() - started:.0f} s | "
                    f"kernel {now['kernel']:.1f} MiB | engines {engines} MiB",
                    flush=True,
                )
        self.probe()

    def finish(self) -> int:
        args = self.args
        base, end = self.parts[0]["rss"], self.parts[-1]["rss"]
        cells = args.cells - args.warmup
        self.local("%nbtrain stop")
        self.kernel.shutdown()
        left = survivors(self.procs)
        grew = [b - a for a, b in zip(base["engines"], end["engines"])]
        kernel = end["kernel"] - base["kernel"]
        print(
            f"\nengine memory: {args.cells} cells of {args.steps} steps on {args.ranks} ranks, "
            f"{args.errors} failing, {self.interrupted} stopped; baseline after cell {args.warmup}"
        )
        for r, (a, b) in enumerate(zip(base["engines"], end["engines"])):
            print(
                f"engine {r} RSS: {a:.1f} -> {b:.1f} MiB: {b - a:+.1f} MiB over {cells} cells "
                f"({(b - a) * 1024 / cells:+.1f} KiB a cell)"
            )
        print(
            f"kernel RSS: {base['kernel']:.1f} -> {end['kernel']:.1f} MiB: {kernel:+.1f} MiB "
            f"({kernel * 1024 / cells:+.1f} KiB a cell)"
        )
        first, last = self.parts[0], self.parts[-1]
        who = [f"engine {r}" for r in range(len(last["ranks"]))] + ["kernel"]
        for name, a, b in zip(
            who, first["ranks"] + [first["kernel"]], last["ranks"] + [last["kernel"]]
        ):
            print(f"{name} keeps (after warm-up -> end, per cell):")
            for part in b:
                was, now = a.get(part, 0), b[part]
                if part.endswith("(count)"):
                    print(f"  {part[:-8]}: {was} -> {now} ({(now - was) / cells:+.1f} a cell)")
                else:
                    print(
                        f"  {part}: {was / 1024:.0f} -> {now / 1024:.0f} KiB "
                        f"({(now - was) / cells:+.0f} B a cell)"
                    )
        print(f"cells that went wrong: {len(self.unexpected)}")
        for reason in self.unexpected:
            print("  " + reason.replace("\n", "\n    "))
        print(f"processes left over: {len(left)}" + (f" (pids {left})" if left else ""))
        bad = bool(self.unexpected or left)
        if any(g > args.max_engine_mib for g in grew) or kernel > args.max_kernel_mib:
            print(
                f"over the limits: engines {args.max_engine_mib} MiB, kernel {args.max_kernel_mib} MiB"
            )
            bad = True
        return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--errors", type=int, default=20, help="cells where a rank raises")
    parser.add_argument("--interrupts", type=int, default=20, help="cells stopped by interrupt")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per cell")
    parser.add_argument(
        "--warmup", type=int, default=None, help="default: the cells that fill the step history"
    )
    parser.add_argument("--max-engine-mib", type=float, default=4.0)
    parser.add_argument("--max-kernel-mib", type=float, default=16.0)
    parser.add_argument("--every", type=int, default=100, help="cells between progress lines")
    args = parser.parse_args(argv)
    if args.warmup is None:  # until the bounded buffers are full: cells/10, at least
        # the cells that fill the step history (DEFAULT_HISTORY rows a rank) and 50 more
        args.warmup = max(5, args.cells // 10, -(-DEFAULT_HISTORY // args.steps) + 50)
    if args.errors + args.interrupts > (args.cells - args.warmup) // 2:
        parser.error("errors and interrupts need at least two cells each after warm-up")
    with tempfile.TemporaryDirectory(prefix="nbtrain-memory-") as work:
        session = Session(args, work)
        try:
            session.run()
        except BaseException:
            session.kernel.shutdown()
            survivors(session.procs)
            raise
        return session.finish()


if __name__ == "__main__":
    sys.exit(main())
