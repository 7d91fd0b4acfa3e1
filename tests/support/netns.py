"""Three machines on one host: `login`, `node1` and `node2`, each a network namespace with
its own loopback, its own host name (a UTS namespace) and one address on a private bridge.

Loopback in `node2` is not `node1`'s, exactly as on a cluster: a listener bound to 127.0.0.1,
an address picked from the wrong interface or a rendezvous that only works locally fails
here as it would there. The file system, the process table and users are shared, so a
Unix socket (munge's) is reachable from every machine and a pid can be signalled from here.

`Machines().up()` makes the bridge, the namespaces and their veth pairs on a /24 of
10.0.0.0/8 that no interface of this host uses; `run`/`popen` start a process on a machine
(`nsenter --net=... unshare --uts ...`, its host name set first); `down()` ends the processes
it started by their PIDs, then deletes the namespaces and the bridge by name. Nothing is
routed off the host: the bridge has no address and no uplink.

Needs root and the `ip` and `unshare` commands; `why_not()` says what is missing.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import shlex
import shutil
import subprocess
import time

NAMES = ("login", "node1", "node2")
_PYTHON = shutil.which("python3") or "python3"
# Reaches an address when a TCP connection to its port 9 is refused (a reset came back).
_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1).close()
except ConnectionRefusedError:
    sys.exit(0)
except OSError as err:
    sys.exit(str(err))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def why_not() -> str | None:
    """Why three namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is missing"
    probe = f"nbtprobe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address of this host falls in."""
    used = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        cidr = line.split()[3]
        used.append(ipaddress.ip_interface(cidr).network)
    rng = random.Random(os.getpid())
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 250)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.0.0.0/8 for the test network")


_AGENT = r"""#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done  # ssh's options
host=$1; shift
exec nsenter --net=/run/netns/@PREFIX@$host unshare --uts \
    sh -c "hostname $host; exec env -i PATH=$PATH HOME=$HOME sh -c \"\$0\"" "$*"
"""


class Machines:
    """The three machines. `address[name]` is a machine's address on the bridge."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.tag = tag
        self.bridge = f"nbtbr{tag}"
        self.netns = {name: f"nbt{tag}-{name}" for name in NAMES}
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.address = {name: str(hosts[i]) for i, name in enumerate(NAMES)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, ...]] = []  # what down() deletes, newest first

    def up(self) -> "Machines":
        atexit.register(self.down)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(NAMES):
                ns = self.netns[name]
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                outer = f"nbt{self.tag}v{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._made.append(("link", "del", outer))
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip(
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.address[name]}/{self.net.prefixlen}",
                    "dev",
                    "eth0",
                )
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        self._wait_reachable()
        return self

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Until node1 and node2 answer from login (a bridge port forwards after a moment)."""
        deadline = time.monotonic() + timeout_s
        for name in NAMES[1:]:
            while True:
                probe = self.run("login", [_PYTHON, "-c", _PROBE, self.address[name]], check=False)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} ({self.address[name]}) unreachable from login: "
                        + (probe.stdout + probe.stderr).strip()[-300:]
                    )
                time.sleep(0.1)

    def argv(self, name: str, argv: list[str]) -> list[str]:
        """`argv` as a command that runs it on machine `name` (host name `name`)."""
        inner = "hostname " + shlex.quote(name) + ' && exec "$@"'
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup file systems
        # slurmd needs.
        netns = f"--net=/run/netns/{self.netns[name]}"
        return ["nsenter", netns, "unshare", "--uts", "sh", "-c", inner, "sh", *argv]

    def remote_agent(self, path: str) -> str:
        """Writes, at `path`, a command that takes ssh's place for a launcher (Open MPI's
        plm_rsh_agent): `AGENT [options] HOST COMMAND...` runs COMMAND on machine HOST
        with a fresh login's environment (PATH and HOME only), as ssh would. Returns path."""
        prefix = self.netns[NAMES[0]][: -len(NAMES[0])]
        with open(path, "w") as f:
            f.write(_AGENT.replace("@PREFIX@", prefix))
        os.chmod(path, 0o755)
        return path

    def run(self, name: str, argv: list[str], timeout: float = 60, check: bool = True, **kw):
        done = subprocess.run(
            self.argv(name, argv), capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} on {name} exited with {done.returncode}: "
                + (done.stderr or done.stdout)[-2000:]
            )
        return done

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """A process on machine `name`, ended by its pid in down()."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(name, argv), **kw)
        self.procs.append(proc)
        return proc

    def end(self, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
        """End one process this started: SIGTERM, then SIGKILL after `timeout_s`."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def down(self) -> None:
        for proc in reversed(self.procs):
            self.end(proc)
        self.procs.clear()
        while self._made:
            _ip(*self._made.pop(), check=False)
