"""Emulated bandwidth-limited cluster: network namespaces + veth + bridge + tc tbf (root only).

CLI: `python -m pipesgd.emulate --workers N --rate 100mbit -- <train overrides>` (see __main__).
API: `Cluster(workers, rates)` as a context manager, for benchmarks. Details and measured link
quality: docs/emulated-cluster.md.
"""

from pipesgd.emulate.cluster import EXIT_TIMEOUT, Cluster, Interrupted, exit_status
from pipesgd.emulate.netns import (
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
