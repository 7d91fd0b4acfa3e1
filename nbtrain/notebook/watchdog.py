"""Ends a cluster's processes when the notebook kernel dies without stopping it.

Run as a script (not `-m`, so it imports neither torch nor nbtrain) with a pipe
from the kernel on stdin. The kernel writes "PID CREATE_TIME" for each process
the cluster starts, "group PGID CREATE_TIME" for each process group a launcher
started (ipyparallel starts the controller and each local engine in a session of its
own, and their children can outlive them), "job JOBID" for a Slurm job it submits,
"file PATH" for the cluster's ipyparallel file, and "stop" when it stops the cluster
itself. End of file means the kernel is gone, however it went (even SIGKILL): the
listed processes that are still the same processes (same creation time) are killed,
what remains of the listed groups too, the listed jobs are cancelled by id
(`scancel`), and the cluster file is removed (else every killed kernel left one in
the profile, naming a cluster that no longer exists).

`Watchdog` is the kernel's end of the pipe and the cluster's list of what to end
(used by `nbtrain.notebook.cluster`).
"""

import os
import signal
import subprocess
import sys

import psutil

_STOP_GRACE_S = 5.0


class Watchdog:
    """The processes, process groups and Slurm job a cluster started: `reap` ends them
    when the cluster stops; the watchdog process ends them if this process dies first."""

    def __init__(self):
        self.procs: list[psutil.Process] = []
        self.groups: dict[int, float] = {}  # pgid -> creation time of its leader
        # Own session: a Ctrl-C in the notebook must not reach it.
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def _send(self, text: str) -> None:
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def pids(self) -> list[int]:
        return sorted(p.pid for p in self.procs)

    def watch(self, pid: int) -> None:
        """This process and its children, as they are now."""
        try:
            proc = psutil.Process(pid)
            found = [proc] + proc.children(recursive=True)
            known = set(self.pids())
            new = [p for p in found if p.pid not in known]
            self._send("".join(f"{p.pid} {p.create_time()}\n" for p in new))
        except psutil.Error:
            return
        self.procs.extend(new)

    def watch_launcher(self, pid: int) -> None:
        """A process ipyparallel launched, and its process group: each launcher process
        leads a session of its own, whose later children a stop during start-up orphans."""
        self.watch(pid)
        try:
            if os.getpgid(pid) != pid or pid in self.groups:
                return
            self.groups[pid] = psutil.Process(pid).create_time()
        except (OSError, psutil.Error):
            return
        self._send(f"group {pid} {self.groups[pid]}\n")

    def watch_job(self, job_id: str) -> None:
        """Cancel this Slurm job if this process dies first."""
        self._send(f"job {job_id}\n")

    def watch_file(self, path: str) -> None:
        """Remove this cluster file (an nbtrain cluster's) if this process dies first."""
        self._send(f"file {path}\n")

    def reap(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for the watched processes to exit, then kill what remains
        of them and of the watched groups (engines blocked in a collective ignore SIGINT)."""
        from .procs import wait_ended  # here: as a script this file imports no package

        alive = wait_ended(self.procs, grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        wait_ended(alive, grace_s)
        for pgid, created in self.groups.items():
            kill_group(pgid, created)

    def stop(self) -> None:
        """The cluster stopped itself: the watchdog exits and touches nothing."""
        self._send("stop\n")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def kill_group(pgid: int, created: float) -> None:
    """SIGKILL to what remains of process group `pgid`, whose leader (a launcher's
    session leader) was created at `created`; nothing if the id names another group."""
    try:
        if abs(psutil.Process(pgid).create_time() - created) >= 0.5:
            return  # the leader's pid names another process now
    except psutil.NoSuchProcess:
        pass  # the leader is gone; its id stays taken while members of its group remain
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:  # no such group left
        pass


def main() -> None:
    procs, groups, jobs, files = [], [], [], []
    for line in sys.stdin:
        line = line.strip()
        if line == "stop":
            return
        try:
            words = line.split(maxsplit=1 if line.startswith("file ") else -1)
            if words[0] == "job":
                jobs.append(words[1])
            elif words[0] == "file":
                files.append(words[1])
            elif words[0] == "group":
                groups.append((int(words[1]), float(words[2])))
            else:
                proc = psutil.Process(int(words[0]))
                if abs(proc.create_time() - float(words[1])) < 0.5:
                    procs.append(proc)
        except (ValueError, IndexError, psutil.Error):
            continue
    for job in jobs:
        try:
            subprocess.run(["scancel", job], timeout=30, capture_output=True)
        except (OSError, subprocess.SubprocessError):
            pass
    for proc in procs:
        try:
            proc.kill()  # psutil refuses if the pid now names another process
        except psutil.Error:
            pass
    for pgid, created in groups:
        kill_group(pgid, created)
    for path in files:
        if os.path.basename(path).startswith("cluster-nbtrain-"):  # only ever ours
            try:
                os.remove(path)
            except OSError:
                pass


if __name__ == "__main__":
    main()
