"""A reduction over torchft's group that a silent peer cannot hold for longer than the lighthouse
takes to notice it.

A replica group that hangs (SIGSTOP, a stuck host, a cut link) keeps its sockets open: a ring hop
waiting on it neither completes nor fails until Gloo's timeout (``trainer.live.timeout_s``, 30 s by
default), and the survivors wait with it, although the lighthouse drops the group from the next
quorum after its heartbeat timeout (1 s by default). So a reduction runs on a thread of its own,
and the communication thread, while it waits, asks the lighthouse every :data:`POLL_S` (once the
reduction has run :data:`GRACE_S`) whether every other group of the reduction's quorum still
heartbeats. When one has gone silent the reduction is given up: :class:`PeerSilent`, which the
engine reports to the Manager like any failed reduction, so the vote drops the update and the next
quorum forms without the silent group.

The thread given up is left behind, blocked in the hop until the silent group answers or Gloo's
timeout ends it. It can do no harm: its hops go to the process group of the quorum it started in
(:meth:`pipesgd.live.group.TorchftGroup.bound`), never to the next one's; what it writes lands in
the buffer of the update the vote dropped; and a reduction with state of its own (top-k,
PowerSGD, error feedback) runs on a copy of that state, which the engine keeps only when the
reduction ends (``LiveEngine._reduce_watched``), so a late hop changes a copy nobody reads.
docs/reliability.md, "What a hang costs".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

GRACE_S = 0.2  # a reduction that ends within this asks the lighthouse nothing
POLL_S = 0.1  # between two reads of the lighthouse's status page while a reduction runs longer


class PeerSilent(RuntimeError):
    """A reduction given up because a group of its quorum stopped heartbeating to the lighthouse."""


def watched(fn: Callable[[], T], silent: Callable[[], list[int]], what: str, left: list[threading.Thread],
            grace_s: float = GRACE_S, poll_s: float = POLL_S) -> T:
    """``fn()`` on a thread of its own: its result, or its exception. Once it has run ``grace_s``,
    ``silent()`` (the quorum's groups the lighthouse no longer hears) is asked every ``poll_s``;
    when it names a group, ``fn`` is given up: :class:`PeerSilent` naming the groups and ``what``,
    its thread appended to ``left`` (for :func:`join_left`). A ``silent()`` that raises (the
    lighthouse out of reach) counts as nothing silent: logged once."""
    done = threading.Event()
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the waiting thread whole)
            outcome["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name="pipesgd-live-reduction", daemon=True)
    thread.start()
    if not done.wait(grace_s):
        unreachable = False
        while not done.wait(poll_s):
            try:
                gone = silent()
            except Exception as e:  # noqa: BLE001 (any failure to read the page: keep waiting)
                if not unreachable:
                    log.warning("cannot ask the lighthouse which groups still heartbeat (%s): %s waits for "
                                "its peers or trainer.live.timeout_s", e, what)
                unreachable = True
                continue
            if gone and not done.is_set():
                left[:] = [t for t in left if t.is_alive()] + [thread]
                names = ", ".join(str(g) for g in gone)
                raise PeerSilent(f"{what} given up: replica group {names} stopped heartbeating to the lighthouse "
                                 "(hung or cut off); the quorum drops this update and forms again without it")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def join_left(left: list[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Wait, ``timeout_s`` in all, for the reductions given up to end (Gloo's timeout ends each at
    the latest): a daemon thread still inside Gloo when the interpreter finalizes is ended by
    ``pthread_exit`` with C++ frames on its stack, and the process dies of SIGABRT after its work
    is done. The threads still running are returned, and logged."""
    if any(t.is_alive() for t in left):
        log.info("waiting up to %.0f s for reductions given up on a silent peer to end in Gloo", timeout_s)
    deadline = time.monotonic() + timeout_s
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = [t for t in left if t.is_alive()]
    if running:
        log.warning("%d reduction(s) given up on a silent peer still wait in Gloo after %.0f s; the process may "
                    "end with them", len(running), timeout_s)
    return running
