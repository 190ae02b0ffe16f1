"""Where a worker runs: ``dist.cpu_affinity`` pins each worker process to one core.

With the default (null) the OS places the workers and may move them between cores while they run;
on a host with as many cores as workers (two ranks on a 2-core machine, or an emulated cluster
whose nodes all share one host) two ranks can then share a core for a while and
a step takes longer for reasons that have nothing to do with the scheme being timed. Pinning takes
that out of a timing:

* ``rank``: core = the allowed cores' (``os.sched_getaffinity``) ``RANK mod count``-th, for one
  host that runs every rank (the local launcher, the emulated cluster: its nodes share one
  host's cores, whatever their ``LOCAL_RANK``);
* ``local_rank``: the ``LOCAL_RANK mod count``-th, for real nodes, each with its own cores.

Every thread of the process is pinned (torch's and the engine's threads made later inherit it), so
a worker's communication thread shares its core. Linux only; elsewhere :func:`pin` refuses with an
error naming the option.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

PINNABLE = sys.platform.startswith("linux")
"""Whether this platform can pin a process to a core (``os.sched_setaffinity``)."""
RULES = ("rank", "local_rank")
"""The values of ``dist.cpu_affinity`` besides null."""


def check_rule(rule: str | None) -> None:
    """ValueError naming ``dist.cpu_affinity`` unless ``rule`` is null or one of :data:`RULES`."""
    if rule is not None and rule not in RULES:
        raise ValueError(f"dist.cpu_affinity={rule!r} is not known; allowed: null, {', '.join(RULES)}")


def core_for(rule: str, rank: int, local_rank: int, allowed: Sequence[int]) -> int:
    """The core a worker of ``rank`` / ``local_rank`` is pinned to under ``rule`` (one of
    :data:`RULES`), from ``allowed``."""
    cores = sorted(allowed)
    if not cores:
        raise ValueError("dist.cpu_affinity: this process may run on no core")
    return cores[(rank if rule == "rank" else local_rank) % len(cores)]


def pin(rule: str | None, rank: int, local_rank: int) -> dict:
    """Pin every thread of this process under ``rule`` (null: leave the OS's placement). Returns the
    placement a run records: ``{"rule", "allowed", "core"}`` (``core`` None when not pinned)."""
    check_rule(rule)
    if not PINNABLE:
        if rule is None:
            return {"rule": None, "allowed": None, "core": None}
        raise ValueError(f"dist.cpu_affinity={rule!r}: this platform cannot pin a process to a core "
                         "(os.sched_setaffinity is Linux-only); use dist.cpu_affinity=null")
    allowed = sorted(os.sched_getaffinity(0))
    if rule is None:
        return {"rule": None, "allowed": allowed, "core": None}
    core = core_for(rule, rank, local_rank, allowed)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:  # a thread that ended since the listing
            pass
    return {"rule": rule, "allowed": allowed, "core": core}


def _threads() -> list[int]:
    """This process's thread ids (the calling thread's alone where /proc is missing)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
