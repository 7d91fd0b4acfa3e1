"""The engines as one Slurm job: options, its place in the queue, its nodes, its end.

`Cluster(launcher="slurm")` submits one batch job through ipyparallel's Slurm
launcher (the script is `launchers.slurm_template`). What this module adds:

- `resolve_layout`: `-n` must equal nodes x tasks per node; checked before submitting.
- `engine_launcher_class`: ipyparallel's launcher, except that a refused submission
  raises `SlurmError` with sbatch's own message instead of a bare exit status.
- `SlurmJob`: the job by id. `wait_running` shows its state and reason while it
  waits in the queue (that time does not count against the start timeout) and fails
  at once when Slurm says it can never start or it ended; `running` tells the cell
  runner within seconds that a job cancelled from outside has taken its ranks along.

Every command runs with the caller's environment (`SLURM_CONF` included).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from .errors import DistributedError

SLURM_KEYS = (
    "nodes",
    "ntasks_per_node",
    "gpus_per_node",
    "gpus_per_task",
    "partition",
    "account",
    "time",
    "options",
)

# squeue states of a job that will not run (again); PENDING and CONFIGURING wait.
_ENDED = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "COMPLETED",
    "COMPLETING",
    "SPECIAL_EXIT",
    "REVOKED",
    "STOPPED",
}
# Pending reasons that no amount of waiting clears: the request exceeds what the
# partition, account or QOS allows (with Slurm's default EnforcePartLimits=NO such a
# job is accepted and then waits forever).
_NEVER = {
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSNotAllowed",
    "DependencyNeverSatisfied",
    "PartitionInactive",
}
_POLL_S = 1.0


class SlurmError(DistributedError):
    """Slurm refused the engines' job, or the job ended before the ranks were ready."""


def resolve_layout(n: int | None, slurm: dict) -> tuple[int, dict]:
    """The number of ranks and the Slurm options with nodes and tasks per node filled in.

    Defaults: 1 node; tasks per node = -n / nodes, else GPUs per node (one rank per
    GPU), else 1. Refuses a mismatch before anything is submitted.

    Raises:
        ValueError: an unknown option, or `n` != nodes x ntasks_per_node.
    """
    slurm = dict(slurm or {})
    unknown = set(slurm) - set(SLURM_KEYS)
    if unknown:
        raise ValueError(f"unknown slurm option(s) {sorted(unknown)}; known: {sorted(SLURM_KEYS)}")
    nodes = int(slurm.get("nodes") or 1)
    per_node = slurm.get("ntasks_per_node")
    if nodes < 1 or (per_node is not None and int(per_node) < 1):
        raise ValueError(f"nodes={nodes}, ntasks_per_node={per_node}: both must be at least 1")
    if per_node is None:
        if n is None:
            per_node = int(slurm.get("gpus_per_node") or 1)
        elif n % nodes:
            raise ValueError(
                f"-n {n} ranks do not divide over {nodes} nodes: pass a multiple of "
                f"{nodes}, or --ntasks-per-node"
            )
        else:
            per_node = n // nodes
    per_node = int(per_node)
    if n is not None and n != nodes * per_node:
        raise ValueError(
            f"-n {n} does not match nodes x tasks per node ({nodes} x {per_node} = "
            f"{nodes * per_node}): pass -n {nodes * per_node}, or --nodes and "
            f"--ntasks-per-node that multiply to {n}"
        )
    slurm.update(nodes=nodes, ntasks_per_node=per_node)
    return nodes * per_node, slurm


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def engine_launcher_class():
    """ipyparallel's SlurmEngineSetLauncher, with sbatch's errors raised as SlurmError."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    class NbtrainSlurmEngineSetLauncher(SlurmEngineSetLauncher):
        # Cluster files name it "slurm", so a later process stops it with ipyparallel's own.
        entrypoint_name = "slurm"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # ipyparallel writes the script into the working folder (the notebook's), one
            # name for every cluster; keep it with the engines' log, named by cluster.
            log_dir = os.path.join(self.profile_dir, "log")
            os.makedirs(log_dir, exist_ok=True)
            self.batch_file = os.path.join(log_dir, f"slurm-engines-{self.cluster_id}.sbatch")

        def _run_command(self, command, **kwargs):
            done = subprocess.run(command, capture_output=True, stdin=subprocess.DEVNULL, **kwargs)
            out = done.stdout.decode("utf8", "replace")
            # scancel of a job that already ended fails too: only sbatch's failure matters
            if done.returncode != 0 and command[:1] == self.submit_command[:1]:
                why = (done.stderr.decode("utf8", "replace") or out).strip()
                raise SlurmError(
                    f"Slurm refused the engines' job ({os.path.basename(command[0])} "
                    f"exited with {done.returncode}): {why}"
                )
            return out

    return NbtrainSlurmEngineSetLauncher


def _short(name: str) -> str:
    return name.split(".")[0].lower()


def this_host_names() -> set[str]:
    names = {_short(socket.gethostname())}
    try:
        names.add(_short(socket.getfqdn()))
    except OSError:
        pass
    return names


def node_hosts(nodes: str = "", partition: str = "") -> dict[str, tuple[str, str]]:
    """Slurm node name -> (host name, address) for `nodes` (a Slurm node list) or the
    nodes of `partition` (default: every node)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N|%n|%o"]
    if nodes:
        argv += ["-n", nodes]
    if partition:
        argv += ["-p", partition]
    try:
        done = _run(argv)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in done.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            found[parts[0]] = (parts[1], parts[2])
    return found


def on_this_host(host: str, address: str) -> bool:
    return _short(host) in this_host_names() or address.startswith("127.")


def refuse_loopback(controller_ip: str, nodes: str = "", partition: str = "") -> None:
    """A controller on loopback cannot be reached from another host: refuse it when a
    node of the job (`nodes`), or before submitting every node of `partition`, is elsewhere.

    Raises:
        ValueError: naming the other hosts and the fix (`--controller-ip`).
    """
    if not controller_ip.startswith("127."):
        return
    everywhere = node_hosts(nodes, partition)
    others = sorted(
        name for name, (host, addr) in everywhere.items() if not on_this_host(host, addr)
    )
    if others and (nodes or len(others) == len(everywhere)):
        raise ValueError(
            f"Slurm node(s) {', '.join(others)} are other hosts and cannot reach a "
            f"controller on {controller_ip}: pass controller_ip (`--controller-ip`) "
            "with an address of this host that the compute nodes can reach"
        )


class QueueReport:
    """Shows the job's state while it waits: a line refreshed in place in Jupyter,
    a new line whenever state or reason changes elsewhere."""

    def __init__(self):
        self.handle, self.last = None, None
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        self.in_kernel = shell is not None and hasattr(shell, "kernel")

    def show(self, text: str, key) -> None:
        if self.in_kernel:
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        elif key != self.last:
            print(text, flush=True)
        self.last = key


class SlurmJob:
    """A Slurm job by id: its state, reason and nodes; cancel it."""

    def __init__(self, job_id: str, output_file: str | None = None):
        self.job_id, self.output_file = str(job_id), output_file
        self.state, self.reason, self.nodes = "PENDING", "", ""
        self._checked = 0.0

    def refresh(self) -> str:
        """Asks squeue; returns the state ("GONE" once the controller forgot the job)."""
        try:
            done = _run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r|%N"], timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return self.state  # the controller is busy: nothing learnt
        line = done.stdout.strip().splitlines()[:1]
        if done.returncode != 0 and "nvalid job id" not in done.stderr:
            return self.state
        if not line:
            self.state, self.reason = "GONE", "no longer in the queue"
        else:
            self.state, self.reason, nodes = (line[0].split("|") + ["", ""])[:3]
            self.nodes = nodes or self.nodes
        self._checked = time.monotonic()
        return self.state

    def running(self, max_age_s: float = 2.0) -> bool:
        """Whether the job still runs (asks squeue at most every `max_age_s`)."""
        if self.state in _ENDED or self.state == "GONE":
            return False
        if time.monotonic() - self._checked >= max_age_s:
            self.refresh()
        return self.state not in _ENDED and self.state != "GONE"

    def describe(self) -> str:
        where = f" on {self.nodes}" if self.nodes and self.state == "RUNNING" else ""
        why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"Slurm job {self.job_id} {self.state}{why}{where}"

    def wait_running(self, report: QueueReport | None = None) -> None:
        """Waits, as long as it takes, until the job runs; shows it while it waits.

        Raises:
            SlurmError: the job can never start (Slurm's reason), or it ended.
        """
        report = report or QueueReport()
        start = time.monotonic()
        while True:
            state = self.refresh()
            if state == "RUNNING":
                if report.last is not None:
                    report.show(
                        f"{self.describe()} after {time.monotonic() - start:.0f} s in the queue",
                        ("RUNNING",),
                    )
                return
            if state in _ENDED or state == "GONE":
                raise self.ended_error("before its engines started")
            if self.reason in _NEVER or self.reason.endswith("PerJobLimit"):
                self.cancel()
                raise SlurmError(
                    f"Slurm job {self.job_id} can never start: Slurm's reason is "
                    f"{self.reason}. The request exceeds what the partition, "
                    "account or QOS allows (nodes, time, GPUs): change the options "
                    "(`sinfo` shows the partitions' limits). The job was cancelled."
                )
            report.show(
                f"{self.describe()}: waiting in the queue for "
                f"{time.monotonic() - start:.0f} s (not counted against the start "
                "timeout; interrupt to cancel)",
                (state, self.reason),
            )
            time.sleep(_POLL_S)

    def ended_error(self, when: str) -> SlurmError:
        tail = self.output_tail()
        return SlurmError(
            f"{self.describe()}: the job ended {when}."
            + (f" Its output ends with:\n{tail}" if tail else "")
        )

    def output_tail(self, lines: int = 12) -> str:
        if not self.output_file or not os.path.exists(self.output_file):
            return ""
        with open(self.output_file, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])

    def cancel(self) -> None:
        """scancel by id (a job already ended is no error)."""
        try:
            _run(["scancel", self.job_id], timeout=15)
        except (OSError, subprocess.TimeoutExpired) as err:
            print(f"nbtrain: scancel {self.job_id} failed: {err}", file=sys.stderr)

    def wait_ended(self, timeout_s: float) -> bool:
        """Waits until no step of the job runs or completes; returns whether it ended."""
        deadline = time.monotonic() + timeout_s
        while self.refresh() in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING"):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
        return True
