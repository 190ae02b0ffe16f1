"""The TCP sockets a process listens on, read from /proc (Linux): its fds' socket inodes matched
against the LISTEN rows of /proc/<pid>/net/tcp and tcp6 (the process's network namespace)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"  # the state column's value for a listening socket (include/net/tcp_states.h)


def listening(pid: int) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, str]]:
    """``(address, port, inode)`` of every TCP socket process ``pid`` holds open and listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                host, port = cols[1].split(":")
                found.add((_address(host), int(port, 16), cols[9]))
    return found


def _address(hex_host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The kernel prints an address as 32-bit words in host byte order."""
    raw = b"".join(struct.pack("=I", int(hex_host[i:i + 8], 16)) for i in range(0, len(hex_host), 8))
    return ipaddress.ip_address(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw))


def on_every_interface(sockets: set) -> list[str]:
    """``host:port`` of each of ``sockets`` (from :func:`listening`) bound to 0.0.0.0 or [::]."""
    return sorted(f"[{a}]:{p}" if a.version == 6 else f"{a}:{p}" for a, p, _ in sockets if a.is_unspecified)
