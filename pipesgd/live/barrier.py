"""The start barrier of replica groups started on their own (a torchrun job each,
``trainer.live.start_replicas``): a group waits, before its first step, until the run's lighthouse
has heard from that many groups of its run. No server of its own: the lighthouse already knows
every group whose Manager heartbeats to it, and lists them on its status page (torchft 0.2.0's
``/status``, on the lighthouse's own address and port). Only replica ids of this run
(``<run id>_<group>:<uuid>``) count. docs/reliability.md, "Live recovery", says when to use it.
"""

from __future__ import annotations

import html
import logging
import re
import time
import urllib.request
from importlib.metadata import version

from . import TORCHFT_VERSION

log = logging.getLogger(__name__)

HEARTBEATS = "<h2>Heartbeats</h2>"  # the section of torchft 0.2.0's status page that lists them
HEARTBEAT = re.compile(r'<li class="heartbeat[^"]*">\s*(.*?): seen ', re.S)
POLL_S = 0.1  # between two reads of the status page: each is one small HTTP request to the lighthouse

# the lighthouse is on the run's own network: never through a proxy the environment names
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def heartbeating(lighthouse: str, timeout_s: float = 5.0) -> list[str]:
    """The replica ids (every run's) the lighthouse at ``lighthouse`` (``http://host:port``) has
    had a heartbeat from, read from its status page. RuntimeError naming torchft's version where
    the page is not shaped as torchft 0.2.0's."""
    with _direct.open(f"{lighthouse.rstrip('/')}/status", timeout=timeout_s) as response:
        page = response.read().decode("utf-8", errors="replace")
    if HEARTBEATS not in page:
        raise RuntimeError(f"the lighthouse at {lighthouse} lists no heartbeats on its status page (torchft "
                           f"{version('torchft')}; pipesgd reads torchft {TORCHFT_VERSION}'s): "
                           "trainer.live.start_replicas cannot count the groups; install "
                           f"torchft=={TORCHFT_VERSION} (pip install 'pipesgd[live]')")
    return [html.unescape(m).strip() for m in HEARTBEAT.findall(page.split(HEARTBEATS, 1)[1])]


def groups_of(run_id: str, replica_ids: list[str]) -> set[int]:
    """The group numbers of run ``run_id`` among ``replica_ids``: the live engine names each
    group's Manager ``<run id>_<group>``, to which torchft appends ``:<uuid>`` for each process
    (a restarted group counts once). Another run's ids are not counted."""
    prefix, groups = f"{run_id}_", set()
    for replica_id in replica_ids:
        name = replica_id.rsplit(":", 1)[0] if ":" in replica_id else replica_id
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            groups.add(int(name[len(prefix):]))
    return groups


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
