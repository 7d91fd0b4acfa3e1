"""A real Slurm cluster on this one host, for the tests (and by hand: run this file).

`SlurmCluster.up()` installs slurm-wlm and munge with apt when they are missing,
writes a munge key and a slurm.conf for this host in a temp folder, starts munged,
slurmctld and slurmd in the foreground as our own child processes, and points
`SLURM_CONF` at the temp folder, so nothing under /etc is touched. `down()` cancels
the cluster's jobs and stops the three daemons by their PIDs. Everything listens on
or talks to loopback (the node's address is 127.0.0.1) and Slurm's own messages are
authenticated by munge.

The node claims at least 2 CPUs whatever the hardware (`SlurmdParameters=config_overrides`)
and there are two partitions: `debug` (the default, no time limit) and `short`
(one minute at most, so that a longer request waits forever with reason
PartitionTimeLimit: a job that can never start).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

_DAEMONS = ("munged", "slurmctld", "slurmd")
_TOOLS = _DAEMONS + ("sbatch", "squeue", "scancel", "sinfo", "srun")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _no_core_dumps() -> None:
    # slurmd raises its soft limits to the hard ones and its tasks inherit them: an engine
    # aborting as its job is cancelled would leave a core file of hundreds of MB in the
    # job's working folder (the checkout).
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def install() -> str | None:
    """Makes sure Slurm and munge are installed; returns why not, or None when they are."""
    if os.geteuid() != 0:
        return "slurmd and this cluster's config (SlurmdUser=root) need root"
    if all(_which(tool) for tool in _TOOLS):
        return None
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another test worker may hold dpkg's lock: wait for it rather than fail.
    install_cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=200", "install", "-y", "-qq"]
    install_cmd += ["slurm-wlm", "munge"]
    # Measured: about a minute with a network; the three steps stay under the tests'
    # 600 s timeout, which counts this fixture's setup too.
    for attempt, limit_s in (
        (install_cmd, 240),
        (["apt-get", "update", "-qq"], 90),
        (install_cmd, 240),
    ):
        try:
            done = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(attempt)}` did not finish within {limit_s} s"
        if attempt is install_cmd and done.returncode == 0:
            break
    else:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return "apt-get could not install slurm-wlm and munge: " + " | ".join(tail)
    missing = [tool for tool in _TOOLS if not _which(tool)]
    return f"after apt-get, still missing {missing}" if missing else None


class SlurmCluster:
    """One controller and one node (this host) with their own config, logs and munge.

    With `machines` (tests/support/netns.py's three machines) the controller runs on
    `login` and one slurmd on each of `node1` and `node2`, each node with its own name,
    address and spool; munged stays here (its socket is a file every machine reaches), and
    `run` asks the controller from `login`.
    """

    def __init__(self, machines=None):
        self.dir = tempfile.mkdtemp(prefix="nbtrain-slurm-")
        os.chmod(self.dir, 0o700)
        self.machines = machines
        self.node = socket.gethostname().split(".")[0]
        self.nodes = ["node1", "node2"] if machines is not None else [self.node]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge.socket")
        self.procs: dict[str, subprocess.Popen] = {}
        self._old_conf = None

    # ----------------------------------------------------------------- setup
    def _write_files(self) -> None:
        key = os.path.join(self.dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        for sub in ["state", "spool"] + [f"spool-{node}" for node in self.nodes]:
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        cpus = max(2, os.cpu_count() or 1)
        d = self.dir
        if self.machines is None:
            controller = f"{self.node}(127.0.0.1)"
            nodes = [f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN"]
        else:  # every machine has its own ports: any free one here serves
            controller = f"login({self.machines.address['login']})"
            nodes = [
                f"NodeName={node} NodeHostname={node} NodeAddr={self.machines.address[node]} "
                f"CPUs={cpus} State=UNKNOWN"
                for node in self.nodes
            ]
        lines = [
            "ClusterName=nbtrain-test",
            f"SlurmctldHost={controller}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            # Measured on Slurm 22.05, neither shortens a test: a job starts at the
            # controller's next 1 s tick whatever batch_sched_delay says, and slurmd
            # waits at least 5 s after scancel's SIGTERM before SIGKILL, whatever KillWait.
            "KillWait=2",
            "MinJobAge=30",
            "InactiveLimit=0",
            "PropagateResourceLimits=NONE",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool" + ("-%n" if self.machines is not None else ""),
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            # Job ids apart from another cluster's (a test worker beside this one): a job's
            # steps are found by their id ("slurmstepd: [1.0]").
            f"FirstJobId={1 if self.machines is None else 1001}",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "PartitionName=short Nodes=ALL MaxTime=1 State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start(self, name: str, argv: list[str], machine: str | None = None) -> None:
        log = open(os.path.join(self.dir, f"{name}.out"), "wb")
        self.procs[name] = subprocess.Popen(
            argv if machine is None else self.machines.argv(machine, argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            preexec_fn=_no_core_dumps,
            start_new_session=True,  # Ctrl-C reaches pytest, which ends them in order
        )
        log.close()

    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster (SLURM_CONF set), output captured."""
        if self.machines is not None:
            argv = self.machines.argv("login", list(argv))
        return subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def up(self, timeout_s: float = 60.0) -> "SlurmCluster":
        """Start the daemons and wait until the node is idle. Raises RuntimeError."""
        atexit.register(self._end_daemons)  # whatever ends this process, but SIGKILL
        self._write_files()
        d = self.dir
        self._start(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={d}/munge.key",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
        )
        self._wait(lambda: os.path.exists(self.munge_socket), 15, "munged did not start")
        if self.machines is None:
            self._start("slurmctld", [_which("slurmctld"), "-D", "-f", self.conf])
            self._start("slurmd", [_which("slurmd"), "-D", "-f", self.conf, "-N", self.node])
        else:
            self._start("slurmctld", [_which("slurmctld"), "-D", "-f", self.conf], "login")
            for node in self.nodes:
                argv = [_which("slurmd"), "-D", "-f", self.conf, "-N", node]
                self._start(f"slurmd-{node}", argv, node)
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.conf  # sbatch/squeue/scancel of the code under test

        def idle():
            out = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=10).stdout.split()
            return bool(out) and all(state == "idle" for state in out)  # a line a partition

        self._wait(idle, timeout_s, "the Slurm node did not become idle")
        return self

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} within {timeout_s:g} s (exited: {dead}):\n" + self.logs()
                )
            time.sleep(0.3)

    def logs(self, lines: int = 15) -> str:
        out = []
        names = ["munged.out", "munged.log", "slurmctld.out", "slurmctld.log"]
        for node in self.nodes:
            names += [f"slurmd-{node}.out" if self.machines else "slurmd.out", f"slurmd-{node}.log"]
        for name in names:
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
                out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -------------------------------------------------------------- teardown
    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still lists (any state)."""
        return self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()

    def _end_daemons(self) -> None:
        """End the daemons this cluster started, by their PIDs. Also run at exit: a
        test run stopped with Ctrl-C left munged, slurmctld and slurmd behind."""
        for name in reversed(list(self.procs)):  # the nodes, the controller, munged
            proc = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def down(self) -> None:
        """Cancel every job of this cluster, then stop the daemons by their PIDs."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            for job in self.jobs():
                self.run("scancel", job, timeout=10)
            deadline = time.monotonic() + 10
            while (
                self.run("squeue", "-h", "-t", "R,CG", "-o", "%i", timeout=10).stdout.split()
                and time.monotonic() < deadline
            ):
                time.sleep(0.3)
        self._end_daemons()
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(machines=None):
    """A cluster that is up inside the block (`SlurmCluster(machines).up()`) and taken
    down after it, however the block or the start ends."""
    cluster = SlurmCluster(machines)
    try:
        yield cluster.up()
    finally:
        cluster.down()


if __name__ == "__main__":  # bring a cluster up by hand, Ctrl-C to stop it
    reason = install()
    if reason:
        sys.exit(reason)
    start = time.monotonic()
    cluster = SlurmCluster().up()
    print(f"Slurm up in {time.monotonic() - start:.1f} s: export SLURM_CONF={cluster.conf}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.down()
