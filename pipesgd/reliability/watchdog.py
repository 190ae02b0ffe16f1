"""Hang diagnosis: where every rank is, and the error a rank raises when a peer stops answering.

Detection itself is the backends' timeout: both process groups are created with
``dist.timeout_s`` (:mod:`pipesgd.dist`), so any collective or point-to-point wait on a silent
peer raises within that time, and the engine bounds its own wait the same way. What a bare backend
error lacks is context. This module supplies it:

* each rank records its step and phase (``compute``, ``engine step``, ``eval``, ``checkpoint``,
  ...): two attribute stores, free;
* a daemon thread publishes them as a heartbeat in the job's TCP store (``MASTER_ADDR:
  MASTER_PORT``, the torchrun contract) when they change, at most every ``POLL_S`` seconds, and
  at least every ``interval`` seconds: at most 10 small ``set`` calls a second, off the loop.
  :meth:`Watchdog.close` joins it, because a daemon thread still inside a store call when the
  interpreter finalizes is ended by ``pthread_exit`` with C++ frames on its stack and the process
  dies of SIGABRT after its work is done (rank 0, the store's host, exiting first while the
  heartbeat reconnects). Its client's short timeout (``BEAT_TIMEOUT_S``) bounds that wait;
* :meth:`Watchdog.explain` turns a communication failure into a one-line :class:`HangError`
  naming this rank's step and phase, what it was blocked on, and which peers went silent (no
  heartbeat for several intervals) with the step and phase each was last seen in.

A SIGSTOPped or deadlocked peer stops heartbeating; a crashed one closes its sockets and makes
the backend fail at once. Heartbeat ages compare the peer's clock with ours: exact on one host,
off by the clock skew across hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..comm import CommError, one_line

log = logging.getLogger(__name__)

# Backend failures that mean "a peer is gone or silent" (Gloo and c10d store wording).
_COMM_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "connection refused")
POLL_S = 0.1
BEAT_TIMEOUT_S = 2.0
"""The heartbeat client's store timeout: a late beat is only retried. Connecting to a closed port,
torch's client retries once after a delay of up to this and gives up after about 2.6 times it."""
CLOSE_WAIT_FACTOR = 3.0
"""close() waits this many beat timeouts (plus 1 s) for a beat in progress; a store host that
accepts and never answers keeps torch's client past any timeout, and its thread is left behind."""


class HangError(RuntimeError):
    """A collective or reduction on this rank timed out or lost a peer; the message says where."""


@dataclass(frozen=True)
class PeerStatus:
    rank: int
    step: int | None = None
    phase: str | None = None
    age_s: float | None = None  # None: never heard from
    where: str = ""             # "pid 123 on host"

    def describe(self) -> str:
        if self.age_s is None:
            return f"rank {self.rank} (no heartbeat at all)"
        return (f"rank {self.rank} ({self.where}; last heartbeat {self.age_s:.1f} s ago, at step {self.step}, "
                f"{self.phase})")


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a timeout or a lost connection to a peer."""
    while exc is not None:
        if isinstance(exc, (CommError, TimeoutError, dist.DistError)):
            return True
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _COMM_WORDS):
            return True
        exc = exc.__cause__
    return False


class Watchdog:
    """This rank's (step, phase), its heartbeat thread, and hang explanations.

    ``store_addr`` is the job's TCP store (host, port) or None (no heartbeats: a lone process, or
    tests). Keys are namespaced by ``attempt`` (the elastic restart count) so a restarted job never
    reads the heartbeats of the attempt before it.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float,
                 store_addr: tuple[str, int] | None = None, attempt: int = 0,
                 interval_s: float | None = None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.step, self.phase = 0, "startup"
        self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 5)
        self._stale_s = max(3 * self.interval_s, 2.0)
        self._store_addr = store_addr if world_size > 1 else None
        self._prefix = f"pipesgd/heartbeat/{attempt}/"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float) -> Watchdog:
        """A watchdog publishing to ``MASTER_ADDR:MASTER_PORT`` when the torchrun env names it."""
        addr = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        store = (addr[0], int(addr[1])) if addr[0] and addr[1] else None
        return cls(rank, world_size, timeout_s, store, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def set(self, phase: str, step: int | None = None) -> None:
        """Record where this rank is (read by the heartbeat thread and by :meth:`explain`)."""
        self.phase = phase
        if step is not None:
            self.step = step

    def start(self) -> Watchdog:
        if self._store_addr is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="pipesgd-heartbeat", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread: at once when it is between beats, at most
        one store call (``CLOSE_WAIT_FACTOR`` times the beat timeout) when the store host is gone."""
        self._stop.set()
        if self._thread is not None:
            wait_s = CLOSE_WAIT_FACTOR * self._beat_timeout_s() + 1.0
            self._thread.join(wait_s)
            if self._thread.is_alive():
                log.warning("heartbeat thread of rank %d is still waiting on the store after %.0f s; it is left "
                            "behind (a store host that accepts and never answers)", self.rank, wait_s)
            self._thread = None

    def _beat_timeout_s(self) -> float:
        return max(min(self.timeout_s, BEAT_TIMEOUT_S), 1.0)

    def _client(self, timeout_s: float):
        host, port = self._store_addr
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    def _beat(self) -> None:
        store, sent, sent_at = None, None, 0.0
        where = f"pid {os.getpid()} on {socket.gethostname()}"
        while not self._stop.is_set():
            state = (self.step, self.phase)
            if state != sent or time.monotonic() - sent_at >= self.interval_s:
                try:
                    store = store or self._client(self._beat_timeout_s())
                    store.set(f"{self._prefix}{self.rank}", f"{state[0]}|{time.time()!r}|{where}|{state[1]}")
                    sent, sent_at = state, time.monotonic()
                except Exception as e:  # the store host may be the silent one; keep trying
                    log.debug("heartbeat of rank %d failed: %s", self.rank, e)
                    store = None
            self._stop.wait(POLL_S)

    def peers(self) -> list[PeerStatus] | None:
        """Every other rank's last heartbeat, or None when the store cannot be read."""
        if self._store_addr is None:
            return None
        try:
            store = self._client(min(5.0, self.timeout_s))
            out = []
            now = time.time()
            for r in range(self.world_size):
                key = f"{self._prefix}{r}"
                if r == self.rank:
                    continue
                if not store.check([key]):
                    out.append(PeerStatus(r))
                    continue
                step, stamp, where, phase = store.get(key).decode().split("|", 3)
                out.append(PeerStatus(r, int(step), phase, max(0.0, now - float(stamp)), where))
            return out
        except Exception as e:
            log.debug("could not read heartbeats: %s", e)
            return None

    def describe_peers(self) -> str:
        statuses = self.peers()
        if statuses is None:
            return "peer heartbeats unavailable (the job's store did not answer)"
        silent = [s for s in statuses if s.age_s is None or s.age_s > self._stale_s]
        if silent:
            return "silent: " + "; ".join(s.describe() for s in silent)
        return "no peer is silent: " + "; ".join(s.describe() for s in statuses)

    def explain(self, exc: BaseException) -> HangError:
        """A one-line error naming this rank's step and phase, what failed, and the silent peers."""
        return HangError(f"rank {self.rank} failed at step {self.step} during {self.phase} "
                         f"(dist.timeout_s={self.timeout_s:g}): {type(exc).__name__}: {one_line(exc)}; "
                         f"{self.describe_peers()}")
