"""What the run's lighthouse knows of the replica groups, read from its status page (torchft
0.2.0's ``/status``, on the lighthouse's own address and port): every replica id it has had a
heartbeat from, those silent for longer than its heartbeat timeout marked ``old``. Replica ids
are ``<run id>_<group>:<uuid>`` (the live engine names each group's Manager ``<run id>_<group>``,
torchft appends a uuid per process: a restarted group's old process stays listed, marked old).
Read by the start barrier (:mod:`.barrier`: who has been heard) and by a reduction waiting on its
peers (:mod:`.watch`: who has gone silent).
"""

from __future__ import annotations

import html
import re
import urllib.request
from importlib.metadata import version

from . import TORCHFT_VERSION

HEARTBEATS = "<h2>Heartbeats</h2>"  # the section of torchft 0.2.0's status page that lists them
HEARTBEAT = re.compile(r'<li class="heartbeat([^"]*)">\s*(.*?): seen ', re.S)

# the lighthouse is on the run's own network: never through a proxy the environment names
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def heartbeats(lighthouse: str, timeout_s: float = 5.0) -> dict[str, bool]:
    """Every replica id (every run's) the lighthouse at ``lighthouse`` (``http://host:port``) has
    had a heartbeat from, and whether that heartbeat is fresh (within the lighthouse's heartbeat
    timeout). RuntimeError naming torchft's version where the page is not shaped as torchft 0.2.0's."""
    with _direct.open(f"{lighthouse.rstrip('/')}/status", timeout=timeout_s) as response:
        page = response.read().decode("utf-8", errors="replace")
    if HEARTBEATS not in page:
        raise RuntimeError(f"the lighthouse at {lighthouse} lists no heartbeats on its status page (torchft "
                           f"{version('torchft')}; pipesgd reads torchft {TORCHFT_VERSION}'s): it cannot tell "
                           f"which replica groups the lighthouse hears; install torchft=={TORCHFT_VERSION} "
                           "(pip install 'pipesgd[live]')")
    return {html.unescape(name).strip(): "old" not in marks.split()
            for marks, name in HEARTBEAT.findall(page.split(HEARTBEATS, 1)[1])}


def heartbeating(lighthouse: str, timeout_s: float = 5.0) -> list[str]:
    """The replica ids the lighthouse has had a heartbeat from, fresh or not."""
    return list(heartbeats(lighthouse, timeout_s))


def group_of(run_id: str, replica_id: str) -> int | None:
    """The group number of ``replica_id`` (``<run id>_<group>[:<uuid>]``) in run ``run_id``; None
    for another run's id."""
    name = replica_id.rsplit(":", 1)[0] if ":" in replica_id else replica_id
    prefix = f"{run_id}_"
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def groups_of(run_id: str, replica_ids) -> set[int]:
    """The group numbers of run ``run_id`` among ``replica_ids`` (a restarted group counts once;
    another run's ids are not counted)."""
    return {g for g in (group_of(run_id, r) for r in replica_ids) if g is not None}


def silent(lighthouse: str, run_id: str, groups, timeout_s: float = 5.0) -> list[int]:
    """Those of ``groups`` (group numbers of run ``run_id``) of which the lighthouse has no fresh
    heartbeat: every process of the group silent past the heartbeat timeout (stopped, hung, cut
    off, or dead), or never heard."""
    fresh = groups_of(run_id, [r for r, ok in heartbeats(lighthouse, timeout_s).items() if ok])
    return sorted(set(groups) - fresh)
