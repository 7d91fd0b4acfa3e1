"""The rendezvous store of a multi-process world, listening on MASTER_ADDR only.

torch's `env://` rendezvous makes rank 0 a TCPStore server bound to every interface
(`*:MASTER_PORT`), whatever MASTER_ADDR says. The store is unauthenticated, and the
recovery protocol trusts its keys (nbtrain.comm.recovery), so on a shared machine
anyone who can reach the port could abort or stop a run. Here rank 0 binds the
listening socket itself, to MASTER_ADDR (127.0.0.1 for a notebook cluster on one
host: loopback only), and hands it to TCPStore (`master_listen_fd`).

Gloo's own connections (a listener per peer) bind to the address its device picks: by
default the one this host's name resolves to, and loopback when the name does not
resolve, which no other host reaches (the ranks of a second node then fail with
"connectFullMesh ... Connection refused, remote=[127.0.0.1]"). `use_interface_toward`
points gloo (GLOO_SOCKET_IFNAME) at the interface this rank reaches MASTER_ADDR through,
unless the user chose one.

Not covered, and why:
  * under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the ranks use the store of
    torchrun's own agent, which torchrun binds to every interface; nbtrain opens no
    listener there (the README says so);
  * a MASTER_ADDR that is no address of this host (a name of a load balancer):
    nothing here can bind to it, so torch's wildcard store is used, with a warning
    naming the exposure.
"""

from __future__ import annotations

import os
import socket
import struct
import warnings
from datetime import timedelta

import torch.distributed as dist


def uses_agent_store() -> bool:
    """Whether torchrun's agent already runs the store (the ranks only connect)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _bound_listener(addr: str, port: int) -> socket.socket | None:
    """A listening socket on (addr, port), or None when addr is not this host's."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as err:
            sock.close()
            if err.errno == 98:  # EADDRINUSE: the port is taken, say so as torch would
                raise RuntimeError(
                    f"the rendezvous port {addr}:{port} is in use; pick another MASTER_PORT"
                ) from err
    return None


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of this host's interface that holds IPv4 address `ip` (Linux), or None."""
    if not hasattr(socket, "if_nameindex"):
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode())
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == ip:
                return name
    return None


def source_address(ip: str) -> str | None:
    """The address of this host's interface toward `ip`, or None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((ip, 9))  # UDP: picks the route, sends nothing
            return sock.getsockname()[0]
    except OSError:
        return None


def use_interface_toward(master_addr: str) -> str | None:
    """Sets GLOO_SOCKET_IFNAME to the interface this host reaches `master_addr` through
    (the user's own GLOO_SOCKET_IFNAME wins); returns the name set, or None."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        target = socket.getaddrinfo(master_addr, None, socket.AF_INET)[0][4][0]
    except OSError:
        return None  # not resolvable: gloo's default, as before
    source = source_address(target)
    if source is None:
        return None  # no IPv4 route: gloo's default, as before
    name = interface_of(source)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def rendezvous_store(rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The store for `init_process_group` (None: let torch's env:// make it).

    Rank 0 serves it on MASTER_ADDR:MASTER_PORT only; the others connect to it.
    """
    if uses_agent_store():
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listen_fd = None
    if rank == 0:
        sock = _bound_listener(addr, port)
        if sock is None:
            warnings.warn(
                f"MASTER_ADDR={addr!r} is not an address of this host, so the "
                f"rendezvous store listens on every interface (port {port}); set "
                "MASTER_ADDR to this host's address to keep it to one",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            listen_fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        addr,
        port,
        world_size=world,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=listen_fd,
    )
