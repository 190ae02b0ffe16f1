"""Userspace delay line: the 'switch' of an emulated cluster with latency (no sch_netem needed).

Started by `Cluster(delay_s > 0)`, not by hand. Every host's namespace holds a persistent TUN
device (`tunI`, its address, tbf on it for the host's uplink). This process attaches to all of
them, reads each IP packet a host sends, and writes it into the destination's device after

    downlink serialization:  start = max(now, busy_until[dst]); busy_until[dst] += bytes / rate[dst]
    propagation:             due = busy_until[dst] + delay

so each link has its rate in both directions (uplink: kernel tbf; downlink: here) and every packet
is delayed by `delay` one way (plus timer slack, set to 1 us, and scheduling delay). A packet
that would wait longer than `queue` for its downlink is dropped, like tbf's queue limit.

Cost: every packet crosses userspace once (~25k packets/s per core in CPython here), so it suits
links up to ~100-200 Mbit/s in aggregate; it runs niced -10 so that training processes on the same
cores delay packets less. Stdlib only and run by path (`python relay.py`), because importing the
pipesgd package imports torch (seconds of start-up for a process that needs none of it).

argv: --delay-s D --queue-s Q  NS:IFNAME:ADDRESS:RATE_BPS ...   prints 'ready' once attached.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import heapq
import logging
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

log = logging.getLogger("pipesgd_lab.emulate.relay")

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, _CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def attach(namespace: str, ifname: str) -> int:
    """Open the persistent TUN device `ifname` living in `namespace`; returns a non-blocking fd."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)  # TUNSETIFF looks the name up in the calling thread's namespace
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", ifname.encode(), _IFF_TUN | _IFF_NO_PI))
        return fd
    finally:
        _setns(home)
        os.close(target)
        os.close(home)


def serve(fds: list[int], addresses: list[str], rates: list[int], delay: float, queue: float) -> None:
    index = {socket.inet_aton(a): i for i, a in enumerate(addresses)}
    seconds_per_byte = [8.0 / r for r in rates]
    busy_until = [0.0] * len(fds)
    pending: list[tuple[float, int, int, bytes]] = []  # (due, seq, dst fd, packet)
    seq = forwarded = dropped = 0

    started = time.monotonic()

    def report(signum: int, frame: object) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu, wall = usage.ru_utime + usage.ru_stime, time.monotonic() - started
        log.info("relay: forwarded %d packets, dropped %d; CPU %.1fs in %.1fs (%.0f%% of a core)",
                 forwarded, dropped, cpu, wall, 100 * cpu / max(wall, 1e-9))
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        # select, not epoll: its timeout has microsecond resolution, epoll's is rounded up to 1 ms
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            for _ in range(64):  # bounded, so one busy host cannot starve the timer
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                dst = index.get(packet[16:20]) if packet and packet[0] >> 4 == 4 else None
                if dst is None:
                    dropped += 1
                    continue
                start = max(now, busy_until[dst])
                if start - now > queue:
                    dropped += 1
                    continue
                busy_until[dst] = start + len(packet) * seconds_per_byte[dst]
                seq += 1
                heapq.heappush(pending, (busy_until[dst] + delay, seq, fds[dst], packet))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, fd, packet = heapq.heappop(pending)
            try:
                os.write(fd, packet)
                forwarded += 1
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EIO, errno.ENOBUFS):
                    raise
                dropped += 1


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(prog="relay.py")
    p.add_argument("--delay-s", type=float, required=True)
    p.add_argument("--queue-s", type=float, required=True)
    p.add_argument("links", nargs="+", help="NS:IFNAME:ADDRESS:RATE_BPS, one per host")
    args = p.parse_args(argv)
    links = [link.split(":") for link in args.links]
    fds = [attach(ns, ifname) for ns, ifname, _, _ in links]
    try:
        os.nice(-10)
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 us instead of 50 us
    except OSError:
        pass
    sys.stdout.write("ready\n")  # handshake line the parent waits for
    sys.stdout.flush()
    serve(fds, [a for _, _, a, _ in links], [int(r) for *_, r in links], args.delay_s, args.queue_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
