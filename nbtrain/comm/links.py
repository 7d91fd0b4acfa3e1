"""The TCP connections of this rank's gloo groups, so that a failure can close them.

Aborting a gloo group (`_abort_process_group`, `ProcessGroup.shutdown`) marks it
aborted but leaves its connections open for as long as anything refers to it: the
frames of a traceback, a `Work` handle, a group kept in a variable. A collective
blocked on such a group, on this rank or on a peer, then waits out the whole group
timeout (minutes). Closing this rank's sending side of each connection (shutdown
with SHUT_WR) makes gloo fail the pending operations at both ends at once, with
"Connection closed by peer", and leaves the process and its other sockets alone.

The connections are told apart from every other socket of the process (the
engine's, the rendezvous store's) by recording which sockets appear while nbtrain
creates its groups (`recording()`); the store's own connections are skipped by port.
Linux only (/proc/self/fd); elsewhere nothing is recorded and nothing is closed.
"""

from __future__ import annotations

import contextlib
import os
import socket

_FD_DIR = "/proc/self/fd"
_RECORDED: dict[int, str] = {}  # fd -> "socket:[inode]", as made by a group


def _sockets() -> dict[int, str]:
    """This process's open sockets: fd -> link text (the inode names the socket)."""
    found = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


@contextlib.contextmanager
def recording():
    """Remember the sockets opened inside (around creating process groups)."""
    before = _sockets()
    try:
        yield
    finally:
        for fd, target in _sockets().items():
            if before.get(fd) != target:
                _RECORDED[fd] = target


def close_all(skip_port: int | None = None) -> int:
    """Shut the sending side of every recorded connection still open.

    `skip_port` is the rendezvous store's port: connections to or from it stay open
    (the store outlives the group and carries the rebuild). Listening sockets and
    fds reused since they were recorded are left alone.

    Returns:
        How many connections were shut.
    """
    current = _sockets()
    shut = 0
    for fd, target in list(_RECORDED.items()):
        if current.get(fd) != target:
            del _RECORDED[fd]  # closed with its group, the number perhaps reused
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ports = (sock.getsockname()[1], sock.getpeername()[1])
            except OSError:
                continue  # a listener: not connected to anyone
            if skip_port is not None and skip_port in ports:
                continue
            try:
                sock.shutdown(socket.SHUT_WR)
                shut += 1
            except OSError:
                pass
    return shut
