"""Emulated bandwidth-limited cluster: network namespaces + veth + bridge + tc tbf (root only).

CLI: `python -m pipesgd_lab.emulate --workers N --rate 100mbit -- <train overrides>` (see __main__).
API: `Cluster(workers, rates, delay_s=0.0)` as a context manager, for benchmarks. With a delay,
TUN devices and a userspace relay (relay.py) replace the veths: this kernel has no sch_netem.
Details and measured link quality: docs/emulated-cluster.md.
"""

from pipesgd_lab.emulate.cluster import EXIT_TIMEOUT, Cluster, Interrupted, exit_status
from pipesgd_lab.emulate.netns import (
    EmulateError,
    EmulateUnavailable,
    Shaping,
    format_rate,
    parse_rate,
    preflight,
)

__all__ = [
    "EXIT_TIMEOUT",
    "Cluster",
    "EmulateError",
    "EmulateUnavailable",
    "Interrupted",
    "Shaping",
    "exit_status",
    "format_rate",
    "parse_rate",
    "preflight",
]
