"""Which host a rank is on, and an address of that host the other ranks can reach.

Run on the engines (through `engine_boot.probe`), so it imports nothing but the
standard library. The rendezvous address (MASTER_ADDR) is rank 0's address as chosen
here, never `gethostbyname(gethostname())`: on a stock Ubuntu host that lookup gives
127.0.1.1 (the /etc/hosts line for the host's own name), which no other host can reach.

The choice, in order:
1. `NBTRAIN_ADDRESS` when set (a user's override; tests use it to make ranks on one
   machine look like ranks on several hosts, together with `NBTRAIN_HOST`);
2. the address this host uses to reach the controller: the engines already reach
   it, so the ranks on other hosts, on the same network, reach this one the same way.
   A controller on loopback gives 127.0.0.1, right for ranks that all share this host;
3. the address of the interface holding the default route;
4. a non-loopback address the host name resolves to; else 127.0.0.1.

Finding the interface toward an address connects a UDP socket, which sends nothing.
"""

from __future__ import annotations

import os
import socket

from ..comm.store import source_address

# Any routable address serves to ask the kernel which interface holds the default route
# (TEST-NET-1, RFC 5737: nothing is sent to it).
_DEFAULT_ROUTE_PROBE = "192.0.2.1"


def host_name() -> str:
    """The name of the host this process is on (`NBTRAIN_HOST` overrides it)."""
    return os.environ.get("NBTRAIN_HOST") or socket.gethostname()


def machine_id() -> str:
    """Names this machine even when `NBTRAIN_HOST` pretends otherwise: the host name
    and the kernel's boot id. Equal ids mean a process's pid can be checked from here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def resolve(name: str) -> list[str]:
    """IPv4 addresses of `name` (a host name or an address), in the resolver's order."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def host_address(peer: str | None = None) -> str:
    """An IPv4 address of this host that the other ranks can reach.

    Args:
        peer: a host or address this host is known to reach (the controller);
            the address of the interface toward it is preferred.
    """
    override = os.environ.get("NBTRAIN_ADDRESS")
    if override:
        return override
    for ip in resolve(peer) if peer else []:
        found = source_address(ip)
        if found:
            return found
    found = source_address(_DEFAULT_ROUTE_PROBE)
    if found and not found.startswith("127."):
        return found
    for ip in resolve(socket.gethostname()):
        if not ip.startswith("127."):  # 127.0.1.1 is this host's name in /etc/hosts, nobody else's
            return ip
    return "127.0.0.1"


def controller_host() -> str | None:
    """The host this engine reached its controller on, as the engine connected to it."""
    import json
    import sys
    from urllib.parse import urlparse

    app = sys.modules.get("ipyparallel.engine.app")  # loaded in engines; never imported here
    url = None
    if app is not None and app.IPEngine.initialized():
        url = getattr(app.IPEngine.instance(), "registration_url", None)
    if not url:
        try:
            info = json.loads(os.environ.get("IPP_CONNECTION_INFO", "{}"))
        except ValueError:
            info = {}
        url = info.get("interface") or ""
        if any(wild in url for wild in ("*", "0.0.0.0")):
            url = "tcp://" + info.get("location", "")
    host = urlparse(url).hostname if url else None
    return host or None
