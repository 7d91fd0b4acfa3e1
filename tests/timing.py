"""`--timing`: where the suite's wall time goes, per folder and for the slowest tests.

Every test's wall time (setup + call + teardown, as pytest measures it) is split into

- start: starting and ending processes: rank processes (nbtrain.launch.run_ranks, up
  to the moment the last rank runs, and their exit), ipyparallel clusters (Cluster.start,
  .stop, .restart), Jupyter kernels (nbclient's and nbval's), and a notebook cell that
  is a `%nbtrain start/stop/restart` line;
- rendezvous: the ranks' process group and `init_distributed` (run_ranks);
- wait: the test process sleeping (time.sleep on the main thread), polling included;
- subprocess: the test process blocked on a child it ran itself (subprocess.run,
  Popen.wait/communicate: torchrun, scripts, launchers), start and work together;
- work: the rest, the test's own computing and the ranks' function.

Only the outermost timed call counts (a sleep inside Cluster.start is start), and only
on the main thread. The table is printed at the end of the run; `--timing-json PATH`
(or $NBTRAIN_TEST_TIMING) also writes every test's row as JSON;
`python tests/timing.py PATH [PATH_AFTER]` prints the table again, or two runs side
by side.

    python -m pytest tests --timing            # the table after the run
    bash tests/run.sh                          # the README's command prints it too
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

PHASES = ("start", "rendezvous", "wait", "subprocess", "work")
SLOWEST = 25
_MAIN = threading.main_thread()
_state = {"current": None, "depth": 0}  # the running test's phase sums; nesting depth
_sleep = time.sleep


def pytest_addoption(parser) -> None:
    # A flag, with the JSON path an option of its own: `--timing tests/x.py` once
    # took the test file for the path and wrote the table over it.
    parser.addoption(
        "--timing",
        action="store_true",
        help="print where the wall time went (per folder, slowest tests)",
    )
    parser.addoption(
        "--timing-json",
        default=os.environ.get("NBTRAIN_TEST_TIMING") or None,
        metavar="PATH",
        help="with --timing, also write each test's phases to PATH as JSON "
        "(default $NBTRAIN_TEST_TIMING); PATH must end in .json",
    )


def _add(phase: str, seconds: float) -> None:
    current = _state["current"]
    if current is not None:
        current[phase] += seconds


def _timed(phase: str, fn):
    """fn, with its wall time counted as `phase` when it is the outermost timed call."""
    if asyncio.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args, **kwargs):
            if threading.current_thread() is not _MAIN or _state["depth"]:
                return await fn(*args, **kwargs)
            _state["depth"] += 1
            t = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _state["depth"] -= 1
                _add(phase, time.perf_counter() - t)

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not _MAIN or _state["depth"]:
            return fn(*args, **kwargs)
        _state["depth"] += 1
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _state["depth"] -= 1
            _add(phase, time.perf_counter() - t)

    return wrapper


def _patch(owner, name: str, phase: str) -> None:
    original = getattr(owner, name, None)
    if original is not None and not getattr(original, "_nbtrain_timed", False):
        wrapped = _timed(phase, original)
        wrapped._nbtrain_timed = True
        setattr(owner, name, wrapped)


def _on_ranks(phases: dict) -> None:
    if threading.current_thread() is not _MAIN or _state["depth"]:
        return
    _add("start", phases["start"] + phases["teardown"])
    _add("rendezvous", phases["rendezvous"])


def _install_probes() -> None:
    _patch(time, "sleep", "wait")
    _patch(subprocess.Popen, "wait", "subprocess")
    _patch(subprocess.Popen, "communicate", "subprocess")
    from nbtrain import launch
    from nbtrain.notebook.cluster import Cluster

    launch.PHASE_LISTENERS.append(_on_ranks)
    for name in ("start", "stop", "restart"):
        _patch(Cluster, name, "start")
    try:
        import nbclient

        for name in (
            "async_start_new_kernel",
            "async_start_new_kernel_client",
            "_async_cleanup_kernel",
        ):
            _patch(nbclient.NotebookClient, name, "start")
    except ImportError:
        pass
    try:
        import nbval.kernel

        _patch(nbval.kernel, "start_new_kernel", "start")
        _patch(nbval.kernel.RunningKernel, "stop", "start")
    except ImportError:
        pass


def _is_start_cell(item) -> bool:
    """A notebook cell whose work is a cluster's start or stop."""
    source = getattr(getattr(item, "cell", None), "source", "") or ""
    lines = [l.strip() for l in source.splitlines() if l.strip() and not l.startswith("#")]  # noqa: E741
    return bool(lines) and all(
        l.startswith(("%nbtrain start", "%nbtrain stop", "%nbtrain restart", "%load_ext"))
        for l in lines  # noqa: E741
    )


class TimingPlugin:
    """Sums the probes per test where the test runs (this process, or an xdist worker)
    and sends them with the test's teardown report, so the table is the same either way."""

    KEY = "nbtrain_timing"

    def __init__(self, config) -> None:
        self.config = config
        self.path = config.getoption("timing_json")
        if self.path and not self.path.endswith(".json"):
            raise pytest.UsageError(
                f"--timing-json {self.path}: the path must end in .json (it is overwritten)"
            )
        self.rows: dict[str, dict] = {}
        _install_probes()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        _state["current"] = dict.fromkeys(PHASES, 0.0)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when == "teardown" and _state["current"] is not None:
            phases = dict(_state["current"])
            if _is_start_cell(item):
                phases = dict.fromkeys(PHASES, 0.0) | {"start": None}  # the whole cell
            report.user_properties.append((self.KEY, phases))
            _state["current"] = None

    def pytest_runtest_logreport(self, report) -> None:
        row = self.rows.setdefault(report.nodeid, dict.fromkeys(("total", *PHASES), 0.0))
        row["total"] += report.duration
        for key, value in report.user_properties:
            if key == self.KEY:
                row.update(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = {}
        for nodeid, row in self.rows.items():
            row = dict(row)
            if row["start"] is None:
                row["start"] = row["total"]
            timed = sum(row[p] for p in PHASES if p != "work")
            row["work"] = max(0.0, row["total"] - timed)
            rows[nodeid] = row
        if self.path:
            Path(self.path).write_text(json.dumps(rows, indent=0))
        for line in table(rows):
            terminalreporter.write_line(line)


def install(config) -> None:
    if config.getoption("timing"):
        config.pluginmanager.register(TimingPlugin(config), "nbtrain-timing")


def folder_of(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return "/".join(parts[:2]) if parts[0] == "tests" and len(parts) > 2 else parts[0]


def _fmt(row: dict, digits: int = 0) -> str:
    return " | ".join(f"{row[k]:.{digits}f}" for k in ("total", *PHASES))


def table(rows: dict, before: dict | None = None) -> list[str]:
    """Markdown lines: per folder, then the slowest tests (seconds)."""
    head = "| total | start | rendezvous | wait | subprocess | work |"
    lines = ["", "Where the time went (s): " + head.replace("|", "").strip()]
    folders: dict[str, dict] = defaultdict(lambda: dict.fromkeys(("total", *PHASES), 0.0))
    counts: dict[str, int] = defaultdict(int)
    for nodeid, row in rows.items():
        f = folder_of(nodeid)
        counts[f] += 1
        for k in ("total", *PHASES):
            folders[f][k] += row[k]
    old = defaultdict(float)
    for nodeid, row in (before or {}).items():
        old[folder_of(nodeid)] += row["total"]
    extra = " before |" if before else ""
    lines += [f"| folder | tests {head}{extra}", "|---" * (8 + bool(before)) + "|"]
    everything = dict.fromkeys(("total", *PHASES), 0.0)
    for f in sorted(folders, key=lambda f: -folders[f]["total"]):
        tail = f" {old[f]:.0f} |" if before else ""
        lines.append(f"| {f} | {counts[f]} | {_fmt(folders[f])} |{tail}")
        for k in everything:
            everything[k] += folders[f][k]
    tail = f" {sum(old.values()):.0f} |" if before else ""
    lines.append(f"| all | {len(rows)} | {_fmt(everything)} |{tail}")
    lines += ["", f"The {SLOWEST} slowest tests (s):", f"| test {head}", "|---" * 7 + "|"]
    for nodeid in sorted(rows, key=lambda n: -rows[n]["total"])[:SLOWEST]:
        lines.append(f"| {nodeid} | {_fmt(rows[nodeid], 1)} |")
    return lines


def module_seconds(rows: dict) -> dict[str, float]:
    """Seconds per module (a file or a notebook), for tests/module_seconds.json."""
    seconds: dict[str, float] = defaultdict(float)
    for nodeid, row in rows.items():
        seconds[nodeid.split("::")[0]] += row["total"]
    return {m: round(t, 1) for m, t in sorted(seconds.items(), key=lambda kv: -kv[1])}


USAGE = """usage: python tests/timing.py TIMING.json [TIMING_AFTER.json]
       python tests/timing.py --module-seconds TIMING.json > tests/module_seconds.json"""

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--module-seconds":
        rows = json.loads(Path(sys.argv[2]).read_text())
        print(json.dumps(module_seconds(rows), indent=0))
        sys.exit(0)
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
        sys.exit(USAGE)
    first = json.loads(Path(sys.argv[1]).read_text())
    if len(sys.argv) == 3:
        print("\n".join(table(json.loads(Path(sys.argv[2]).read_text()), before=first)))
    else:
        print("\n".join(table(first)))
