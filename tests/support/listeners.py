"""The listening TCP sockets of a process, read from /proc (Linux), for the tests that
check nbtrain opens no listener on a wildcard address."""

from __future__ import annotations

import os
import socket
import struct

WILDCARDS = {"0.0.0.0", "::"}


def _address(hex_addr: str) -> str:
    if len(hex_addr) == 8:  # IPv4, little-endian
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = [struct.pack("<I", int(hex_addr[i : i + 8], 16)) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    return [local for local, _ in _sockets(pid, "0A")]  # 0A: LISTEN


def connected(pid: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """(local, remote) (address, port) pairs of every established TCP connection of `pid`."""
    return _sockets(pid, "01")  # 01: ESTABLISHED


def _sockets(pid: int, wanted: str) -> list:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if state == wanted and inode in inodes:
                found.append((_endpoint(local), _endpoint(remote)))
    return found


def _endpoint(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    addr = _address(addr)
    if addr.startswith("::ffff:") and "." in addr:  # an IPv4 peer of an IPv6 socket
        addr = addr[len("::ffff:") :]
    return addr, int(port, 16)
