"""The start barrier of replica groups started on their own (a torchrun job each,
``trainer.live.start_replicas``): a group waits, before its first step, until the run's lighthouse
has heard from that many groups of its run. No server of its own: the lighthouse already knows
every group whose Manager heartbeats to it, and lists them on its status page (:mod:`.status`).
Only replica ids of this run (``<run id>_<group>:<uuid>``) count. docs/reliability.md, "Live
recovery", says when to use it.
"""

from __future__ import annotations

import logging
import time

from .status import groups_of, heartbeating

log = logging.getLogger(__name__)

POLL_S = 0.1  # between two reads of the status page: each is one small HTTP request to the lighthouse


def wait_for_groups(lighthouse: str, run_id: str, count: int, timeout_s: float,
                    timeout_key: str = "trainer.live.start_timeout_s") -> set[int]:
    """Block until the lighthouse has heard from ``count`` groups of run ``run_id`` (this one
    included, once its Manager heartbeats); return their numbers. A group restarted later finds
    its peers already heard and goes on at once. TimeoutError naming ``trainer.live.start_replicas``
    and ``timeout_key`` after ``timeout_s``."""
    start = time.monotonic()
    seen = groups_of(run_id, heartbeating(lighthouse))
    if len(seen) < count:
        log.info("waiting for %d replica groups of run %s at the lighthouse %s (heard: %s)", count, run_id,
                 lighthouse, sorted(seen))
    while len(seen) < count:
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"trainer.live.start_replicas={count}: the lighthouse at {lighthouse} heard from "
                               f"{len(seen)} replica group(s) of run {run_id!r} ({sorted(seen)}) within "
                               f"{timeout_key}={timeout_s:g} s; start the others (each with the same "
                               "trainer.live.run_id), or lower trainer.live.start_replicas")
        time.sleep(POLL_S)
        seen = groups_of(run_id, heartbeating(lighthouse))
    log.info("start barrier: %d replica groups of run %s heard by the lighthouse after %.2f s: %s", len(seen),
             run_id, time.monotonic() - start, sorted(seen))
    return seen
