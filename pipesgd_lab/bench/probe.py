"""How fast this host is right now: a fixed CPU workload timed between two timing runs.

A shared host's speed moves under a study (docs/convergence.md, the GPT timing: compute alone
read 634 and 809 ms a step twenty minutes apart, with no steal time reported), so a timing row that
says only what it measured cannot tell a faster scheme from a faster minute. A probe before and after each
run says whether the host held still while it ran, and how fast it was compared with the other
runs of the study. The workload is fp32 matrix products on every core, the kernels training spends
its time in; the machine should be otherwise idle (the study's rule for a timing measurement).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

SIZE = 256  # n of the n×n products: 2n³ flops each, about a millisecond on one core
MOVED = 0.05
"""A run during which the probe changed by more than this fraction (after/before − 1) ran on a host
that moved under it; so did one whose probes sit further than this from the link's median."""


def speed(seconds: float = 1.0, threads: int | None = None) -> dict:
    """GFLOP/s of ``SIZE``×``SIZE`` fp32 matrix products on ``threads`` (default: every core) for
    about ``seconds``, and the median of its ten slices (``gflops``; the slices' range beside it).
    Restores torch's thread count."""
    import torch  # the study's parent process needs torch only here

    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r}: the probe needs a positive duration")
    threads = threads or os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(SIZE, SIZE, generator=torch.Generator().manual_seed(0))
        out = torch.empty_like(a)
        torch.mm(a, a, out=out)  # the first product allocates and spins the thread pool up
        flops = 2 * SIZE ** 3
        rates = []
        for _ in range(10):
            n, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 10:
                torch.mm(a, a, out=out)
                n += 1
            rates.append(n * flops / elapsed / 1e9)
    finally:
        torch.set_num_threads(before)
    return {"gflops": statistics.median(rates), "range": [min(rates), max(rates)], "threads": threads,
            "seconds": seconds}


@contextmanager
def around(seconds: float) -> Iterator[dict]:
    """Probe (:func:`speed`, ``seconds`` each) before and after the block, into the dict it yields
    (``before``, ``after``); with ``seconds`` 0 it probes nothing and the dict stays empty."""
    got: dict = {}
    if seconds:
        got["before"] = speed(seconds)
    yield got
    if seconds:
        got["after"] = speed(seconds)


def summary(rows: Iterable[dict]) -> dict | None:
    """Over timing rows carrying ``host_speed`` (``{"before": probe, "after": probe}``): the median
    and range of every probe, and the runs the host moved under (:data:`MOVED`): those whose two
    probes differ, or whose probes stand apart from the median. None if no row has a probe."""
    probed = [r for r in rows if r.get("host_speed")]
    if not probed:
        return None
    values = [r["host_speed"][side]["gflops"] for r in probed for side in ("before", "after")]
    median = statistics.median(values)
    moved = []
    for r in probed:
        before, after = (r["host_speed"][side]["gflops"] for side in ("before", "after"))
        during, apart = after / before - 1, (before + after) / 2 / median - 1
        if abs(during) > MOVED or abs(apart) > MOVED:
            moved.append({"arm": r["arm"], "repeat": r.get("repeat"), "before": before, "after": after,
                          "during": during, "from_median": apart})
    return {"median_gflops": median, "range_gflops": [min(values), max(values)], "runs": len(probed),
            "moved": moved, "moved_threshold": MOVED}
