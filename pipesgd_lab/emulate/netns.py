"""Thin, typed wrappers over `ip` and `tc`: pre-flight checks, rate parsing, link shaping arguments.

Nothing here keeps state; `cluster.Cluster` decides what to create and what to tear down. Every
command runs with an explicit namespace (`ip -n NS ...`, `tc -n NS ...`), so the host's own network
configuration is read at most (to pick a subnet that does not look like one of its own) and never
changed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# tc's rate units are SI (1 mbit = 10**6 bit/s). tc's "bps"/"mbps" mean BYTES per second, a classic
# trap, so only the unambiguous bit units are accepted.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

# Ethernet MTU frame plus headroom; tbf needs burst >= the largest packet it has to pass in one go.
_MIN_BURST_BYTES = 16 * 1024
# Token bucket depth in time: how long the link may send at veth speed after being idle. Short keeps
# the emulated link honest (no 100 ms line-rate bursts), long enough that the 250 Hz kernel timer and
# GSO segmentation do not cost throughput (measured, see docs/emulated-cluster.md).
DEFAULT_BURST_S = 0.002
# Interface MTU of every emulated link (veths, bridge, TUN). 9000, jumbo frames, as cluster NICs are
# set up: the kernel's per-packet cost (TCP, veth, bridge, tbf, all in softirq on the shared cores)
# then falls about fivefold per megabyte, where 1500-byte frames made the emulated link itself eat a
# share of the compute cores that a real NIC (TSO/GRO in hardware) does not. The shaped rate stays
# as exact (docs/emulated-cluster.md, "Link cost"). 1500 is the earlier link, kept as an option.
DEFAULT_MTU = 9000
MIN_MTU, MAX_MTU = 1280, 9000
# tbf's `latency` is the longest a packet may WAIT in the shaper queue before being dropped (it sets
# the queue length: limit = rate * latency + burst). It adds no delay to an idle link.
DEFAULT_QUEUE_S = 0.050
# The shortest queue in bytes: eight jumbo frames. At 50 ms a 1mbit link queued 6 kB (under one
# 9014-byte frame beside the burst), dropped TCP's bursts and reached 80 % of its rate (0.8 Mbit/s,
# 1 MB x 3 each way); eight frames (577 ms there, 115 ms at 5mbit, under 50 ms from 12mbit up, so
# faster links keep their queue) gave 1.0 Mbit/s (docs/emulated-cluster.md, "Slow links").
MIN_QUEUE_BYTES = 8 * (MAX_MTU + 14)

EX_NOPERM = 77  # sysexits.h: not root
EX_UNAVAILABLE = 69  # sysexits.h: ip/tc/netns missing


class EmulateError(RuntimeError):
    """A step of building, running or tearing down the emulated cluster failed."""


class EmulateUnavailable(EmulateError):
    """This machine or user cannot emulate a cluster; `exit_code` follows sysexits.h."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def parse_rate(rate: str | int) -> int:
    """'100mbit' -> 100_000_000 (bit/s). Units: bit, kbit, mbit, gbit, tbit (SI, as in tc)."""
    if isinstance(rate, int):
        value, unit = float(rate), "bit"
    else:
        match = _RATE_RE.match(rate)
        if match is None:
            raise ValueError(f"rate={rate!r} is not '<number><unit>', e.g. '100mbit' or '1gbit'")
        value, unit = float(match[1]), (match[2].lower() or "bit")
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"rate={rate!r}: unit {unit!r} not allowed; use one of {sorted(_RATE_UNITS)} "
            "(tc's 'bps'/'mbps' mean bytes per second and are rejected to avoid an 8x mistake)"
        )
    bits = int(round(value * _RATE_UNITS[unit]))
    if bits < 8000:
        raise ValueError(f"rate={rate!r} is below 8kbit; tbf cannot shape that usefully")
    return bits


def format_rate(bits_per_s: int) -> str:
    """100_000_000 -> '100mbit' (largest unit that divides exactly)."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


@dataclass(frozen=True)
class Shaping:
    """tbf parameters for one direction of one link."""

    rate_bps: int
    burst_bytes: int
    queue_s: float

    @classmethod
    def for_rate(
        cls, rate_bps: int, burst_s: float = DEFAULT_BURST_S, queue_s: float = DEFAULT_QUEUE_S
    ) -> Shaping:
        burst = max(_MIN_BURST_BYTES, int(rate_bps / 8 * burst_s))
        return cls(rate_bps=rate_bps, burst_bytes=burst, queue_s=max(queue_s, MIN_QUEUE_BYTES * 8 / rate_bps))

    def tc_args(self) -> list[str]:
        """Arguments after `tc qdisc add dev IF root`."""
        return [
            "tbf",
            "rate", f"{self.rate_bps}bit",
            "burst", str(self.burst_bytes),
            "latency", f"{max(1, round(self.queue_s * 1000))}ms",
        ]  # fmt: skip


def preflight() -> None:
    """Raise EmulateUnavailable naming the first missing requirement. Creates nothing."""
    if os.geteuid() != 0:
        raise EmulateUnavailable(
            "pipesgd_lab.emulate needs root (it creates network namespaces, veth pairs and tc qdiscs); "
            "rerun with sudo",
            EX_NOPERM,
        )
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise EmulateUnavailable(
                f"pipesgd_lab.emulate needs the '{tool}' command ({package}), not found on PATH",
                EX_UNAVAILABLE,
            )
    if not os.path.exists("/proc/self/ns/net"):
        raise EmulateUnavailable(
            "pipesgd_lab.emulate needs network namespace support (/proc/self/ns/net is missing)",
            EX_UNAVAILABLE,
        )
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise EmulateUnavailable(
            f"pipesgd_lab.emulate: 'ip netns list' failed: {probe.stderr.strip()}", EX_UNAVAILABLE
        )


def sh(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ip/tc command; on failure raise EmulateError with the command and its stderr."""
    log.debug("$ %s", " ".join(args))
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise EmulateError(f"'{' '.join(args)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    out = sh(["ip", "netns", "list"]).stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    done = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def pick_subnet(seed: int) -> str:
    """A '10.213.X' prefix that none of the host's addresses or routes use.

    The namespaces are isolated, so a clash could not leak traffic anyway; avoiding one keeps
    `ip` output unambiguous for whoever debugs it.
    """
    host = sh(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    host += sh(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    for k in range(256):
        x = (seed + k) % 254 + 1
        if f"10.213.{x}." not in host:
            return f"10.213.{x}"
    raise EmulateError("no free 10.213.X.0/24 subnet: the host uses all of them")
