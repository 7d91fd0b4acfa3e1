"""Fails a test module that leaves process-wide state behind, naming what it left.

The suite runs hundreds of modules in one pytest process. A module that leaves a
cluster running, a process group initialised, SIGINT ignored or an environment
variable set changes what every later module sees: the run then passes or fails by
the order of the modules. (It happened: an interrupt test left a cluster "current",
and the Slurm tests after it started nothing.)

So before the first test of each module (test file or notebook) this plugin records

- the SIGINT handler;
- nbtrain's clusters started in this process, and the cluster files under $IPYTHONDIR
  (clusters that a notebook kernel started);
- torch.distributed's default group, nbtrain's context and its recovery watcher;
- the environment variables;
- the threads and the child processes of this process;

and after the module's last teardown (its module fixtures are gone by then) it
compares. Anything new is reported as an error of that module's last test, one line
per leftover, and then put back or ended (clusters by id, processes by pid), so one
leaky module does not make the next ones fail too.

Things that live for the whole session on purpose are not leftovers: the forkserver
that `nbtrain.launch.run_ranks` starts once and the multiprocessing resource tracker
(by their command lines), and the threads listed in SESSION_THREADS.

Install it from a conftest:

    from state_guard import StateGuard
    def pytest_configure(config):
        StateGuard.install(config)
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

import pytest

PLUGIN_NAME = "nbtrain-state-guard"
# Session-long helpers started on first use, by name: IPython's history writer (the
# shell singleton lives as long as the process), tqdm's monitor and the dashboard's
# drawing thread (one for the session: nbtrain/notebook/dashboard.py).
SESSION_THREADS = ("IPythonHistorySavingThread", "tqdm_monitor", "nbtrain-dashboard-draw")
SESSION_CHILDREN = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
# How long a thread or a child may take to end after the module's teardown (engine
# nannies and gloo's threads take a few seconds). NBTRAIN_STATE_GRACE_S overrides it
# (tests/unit/test_state_guard.py's leaking module waits out the grace twice).
GRACE_S = float(os.environ.get("NBTRAIN_STATE_GRACE_S", "10"))
# Set by pytest itself, or once per process by a library as its own cache setting
# (torch's inductor exports its cache folder on first use, for its compile workers).
IGNORED_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _children() -> dict[int, str]:
    """pid -> command line of every live descendant of this process."""
    import psutil

    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            found[proc.pid] = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
    return found


def _session_child(cmdline: str) -> bool:
    return any(name in cmdline for name in SESSION_CHILDREN)


def _cluster_files() -> set[str]:
    root = os.environ.get("IPYTHONDIR")
    if not root:
        return set()
    return set(glob.glob(os.path.join(root, "profile_*", "security", "cluster-nbtrain-*.json")))


def _live_clusters() -> list:
    leftovers = sys.modules.get("nbtrain.notebook.leftovers")
    return [] if leftovers is None else [c for c in leftovers.live_clusters() if c.running]


def _current_cluster():
    magics = sys.modules.get("nbtrain.notebook.magics")
    return None if magics is None else magics.current_cluster()


def _dist_group() -> str | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return f"backend {dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}"


def _nbtrain_context():
    context = sys.modules.get("nbtrain.comm.context")
    return None if context is None else context._CONTEXT


def _events_on() -> bool:
    events = sys.modules.get("nbtrain.comm.events")
    return events is None or events.HUB.enabled


def _recovery_armed() -> bool:
    recovery = sys.modules.get("nbtrain.comm.recovery")
    return recovery is not None and recovery.armed()


class Snapshot:
    """The process-wide state a test module may change."""

    def __init__(self):
        self.sigint = signal.getsignal(signal.SIGINT)
        self.env = {k: v for k, v in os.environ.items() if k not in IGNORED_ENV}
        self.threads = set(threading.enumerate())
        self.children = _children()
        self.cluster_files = _cluster_files()
        self.clusters = {id(c) for c in _live_clusters()}
        self.dist_group = _dist_group()
        self.context = _nbtrain_context()
        self.recovery_armed = _recovery_armed()
        self.events_on = _events_on()


class StateGuard:
    def __init__(self):
        self.module: str | None = None
        self.before: Snapshot | None = None

    @classmethod
    def install(cls, config: pytest.Config) -> "StateGuard":
        guard = config.pluginmanager.get_plugin(PLUGIN_NAME)
        if guard is None:
            guard = cls()
            config.pluginmanager.register(guard, PLUGIN_NAME)
        return guard

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        if _module_of(item) != self.module:
            self.module, self.before = _module_of(item), Snapshot()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):
        result = yield
        if self.before is not None and (nextitem is None or _module_of(nextitem) != self.module):
            before, self.before, self.module = self.before, None, None
            left = self.check_and_restore(before)
            if left:
                pytest.fail(
                    f"{_module_of(item)} left process-wide state behind "
                    "(put back now, so later modules start clean):\n  - " + "\n  - ".join(left),
                    pytrace=False,
                )
        return result

    # -- the check -------------------------------------------------------------------

    def check_and_restore(self, before: Snapshot) -> list[str]:
        """What differs from `before`, one line each; each is put back or ended."""
        left: list[str] = []
        left += self._sigint(before)
        left += self._clusters(before)
        left += self._distributed(before)
        left += self._events(before)
        left += self._environment(before)
        left += self._threads(before)
        left += self._processes(before)
        return left

    @staticmethod
    def _sigint(before: Snapshot) -> list[str]:
        now = signal.getsignal(signal.SIGINT)
        if now is before.sigint:
            return []
        signal.signal(signal.SIGINT, before.sigint)
        return [
            f"the SIGINT handler is {now!r} (was {before.sigint!r}): "
            "Ctrl-C no longer does what it did"
        ]

    @staticmethod
    def _clusters(before: Snapshot) -> list[str]:
        left = []
        current = _current_cluster()
        for cluster in _live_clusters():
            if id(cluster) in before.clusters:
                continue
            role = " (the current cluster of %nbtrain)" if cluster is current else ""
            left.append(f"nbtrain cluster {cluster.cluster_id} still running{role}")
            cluster.stop()
        files = sorted(_cluster_files() - before.cluster_files)
        for path in files:
            left.append(
                f"a cluster file under $IPYTHONDIR: {os.path.basename(path)} "
                "(a cluster a notebook kernel started and never stopped)"
            )
        if files:
            from nbtrain.notebook.cluster import stop_leftover_clusters

            stop_leftover_clusters(os.environ["IPYTHONDIR"])
        return left

    @staticmethod
    def _distributed(before: Snapshot) -> list[str]:
        left = []
        if _recovery_armed() and not before.recovery_armed:
            left.append("nbtrain's recovery watcher is still armed (recovery.disarm())")
            sys.modules["nbtrain.comm.recovery"].disarm()
        group = _dist_group() if before.dist_group is None else None
        if group is not None:
            left.append(f"torch.distributed's default group is still initialised ({group})")
        context = _nbtrain_context() if before.context is None else None
        if context is not None:
            left.append(
                f"nbtrain's context is still set (rank {context.rank} of "
                f"{context.world_size}; nbtrain.comm.shutdown())"
            )
        if group is not None or context is not None:
            import nbtrain.comm

            nbtrain.comm.shutdown(barrier=False)
        return left

    @staticmethod
    def _events(before: Snapshot) -> list[str]:
        if _events_on() or not before.events_on:
            return []
        sys.modules["nbtrain.comm.events"].set_enabled(True)
        return [
            "nbtrain's events are switched off (telemetry.set_enabled(False)): no "
            "telemetry, metric or dashboard update in this process"
        ]

    @staticmethod
    def _environment(before: Snapshot) -> list[str]:
        now = {k: v for k, v in os.environ.items() if k not in IGNORED_ENV}
        left = []
        for key in sorted(set(now) | set(before.env)):
            if now.get(key) == before.env.get(key):
                continue
            if key not in before.env:
                left.append(f"environment variable {key}={now[key]!r} was set")
                del os.environ[key]
            elif key not in now:
                left.append(f"environment variable {key} was removed (was {before.env[key]!r})")
                os.environ[key] = before.env[key]
            else:
                left.append(f"environment variable {key}={now[key]!r} (was {before.env[key]!r})")
                os.environ[key] = before.env[key]
        return left

    @staticmethod
    def _threads(before: Snapshot) -> list[str]:
        def new():
            return [
                t
                for t in threading.enumerate()
                if t not in before.threads
                and t.is_alive()
                and not t.name.startswith(SESSION_THREADS)
            ]

        deadline = time.monotonic() + GRACE_S
        for thread in new():
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        # A thread cannot be ended from outside: name it, and leave it.
        return [
            f"thread {t.name!r} still running ({'daemon' if t.daemon else 'not daemon'}, "
            f"target {getattr(t, '_target', None)!r})"
            for t in new()
        ]

    @staticmethod
    def _processes(before: Snapshot) -> list[str]:
        import psutil

        def new():
            return {
                pid: cmd
                for pid, cmd in _children().items()
                if pid not in before.children and not _session_child(cmd)
            }

        deadline = time.monotonic() + GRACE_S
        while new() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = []
        for pid, cmd in sorted(new().items()):
            left.append(f"child process {pid} still running: {cmd[:160]}")
            try:  # ours (a descendant of this process), ended by its pid
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        return left
