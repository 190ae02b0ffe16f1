"""How a replica group finds its run: :class:`LiveOptions`, given or read from the environment the
live launcher sets. Pure data (no torch). Its place among the groups (number, count, restarts) is
read by :mod:`pipesgd.launch`, below the wing, where fault injection reads it too."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..launch import ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, replica_attempt, replica_shard  # noqa: F401

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LiveOptions:
    """Where this replica group finds the others. ``lighthouse``: the lighthouse's address
    (``http://host:port``); ``run_id``: the run's id, checked before any state moves between
    replicas; ``replica``: this group's number (stable across its restarts; its data position
    follows it); ``host``: the address this replica's store and state server listen on and
    advertise. ``timeout_s``: a reduction, a commit vote or a state transfer; ``quorum_timeout_s``:
    forming a quorum. ``min_replicas``: fewest replica groups that may commit a step.
    ``init_sync``: torchft's start: every group but one loads that one's state before its first
    update (its first two gradients then count for nothing, as a healer's); False where every
    group builds the same initial weights (the composition root seeds them alike).
    ``start_replicas``: a group started on its own (torchrun) waits before its first step until
    the lighthouse has heard from that many groups of its run (:mod:`pipesgd.live.barrier`);
    None: it does not wait (the live launcher's groups wait for each other anyway).
    ``start_timeout_s``: the most a group waits at its start barrier (None: ``quorum_timeout_s``)."""

    lighthouse: str
    run_id: str
    replica: int
    host: str = LOOPBACK
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    min_replicas: int = 1
    init_sync: bool = True
    start_replicas: int | None = None
    start_timeout_s: float | None = None

    def __post_init__(self):
        if isinstance(self.replica, bool) or not isinstance(self.replica, int) or self.replica < 0:
            raise ValueError(f"live.replica={self.replica!r}: must be an integer >= 0")
        if not self.lighthouse:
            raise ValueError("live.lighthouse is empty: the lighthouse's address (http://host:port) is needed")
        if not self.host:
            raise ValueError("trainer.live.host='' would listen on every interface; name the address (e.g. 127.0.0.1)")
        for name, value in (("timeout_s", self.timeout_s), ("quorum_timeout_s", self.quorum_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"trainer.live.{name}={value!r} is invalid: must be a number of seconds > 0")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"trainer.live.min_replicas={self.min_replicas!r} is invalid: must be an integer >= 1")
        start = self.start_replicas
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1):
            raise ValueError(f"trainer.live.start_replicas={start!r} is invalid: must be an integer >= 1 (the "
                             "replica groups to wait for at start), or null for no wait")
        wait = self.start_timeout_s
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait > 0):
            raise ValueError(f"trainer.live.start_timeout_s={wait!r} is invalid: must be a number of seconds > 0, "
                             "or null for trainer.live.quorum_timeout_s")

    def start_wait_s(self) -> tuple[str, float]:
        """The start barrier's limit and the key that sets it."""
        if self.start_timeout_s is not None:
            return "trainer.live.start_timeout_s", float(self.start_timeout_s)
        return "trainer.live.quorum_timeout_s", float(self.quorum_timeout_s)


ENV_LIGHTHOUSE = "PIPESGD_LIVE_LIGHTHOUSE"
ENV_RUN_ID = "PIPESGD_LIVE_RUN_ID"
ENV_HOST = "PIPESGD_LIVE_HOST"
ENV_TIMEOUT = "PIPESGD_LIVE_TIMEOUT_S"
ENV_QUORUM_TIMEOUT = "PIPESGD_LIVE_QUORUM_TIMEOUT_S"
ENV_MIN_REPLICAS = "PIPESGD_LIVE_MIN_REPLICAS"
ENV_INIT_SYNC = "PIPESGD_LIVE_INIT_SYNC"
ENV_START_REPLICAS = "PIPESGD_LIVE_START_REPLICAS"
ENV_START_TIMEOUT = "PIPESGD_LIVE_START_TIMEOUT_S"
ENV_START = "PIPESGD_LIVE_START_STORE"  # host:port of the launcher's store: the replica groups start together
ENV_SPAWNED = "PIPESGD_LIVE_SPAWNED_AT"  # unix time at which the launcher started this process


def replica_env(options: LiveOptions) -> dict[str, str]:
    """The variables :func:`options_from_env` reads back as ``options``, for a replica group's process."""
    env = {ENV_LIGHTHOUSE: options.lighthouse, ENV_RUN_ID: options.run_id, ENV_REPLICA: str(options.replica),
           ENV_HOST: options.host, ENV_TIMEOUT: repr(float(options.timeout_s)),
           ENV_QUORUM_TIMEOUT: repr(float(options.quorum_timeout_s)), ENV_MIN_REPLICAS: str(options.min_replicas),
           ENV_INIT_SYNC: str(int(options.init_sync))}
    if options.start_replicas is not None:
        env[ENV_START_REPLICAS] = str(options.start_replicas)
    if options.start_timeout_s is not None:
        env[ENV_START_TIMEOUT] = repr(float(options.start_timeout_s))
    return env


def options_from_env() -> LiveOptions | None:
    """:class:`LiveOptions` from the environment; None where none of it is set (a lone process);
    ValueError naming what is missing where some is."""
    missing = [k for k in (ENV_LIGHTHOUSE, ENV_RUN_ID, ENV_REPLICA) if not os.environ.get(k)]
    if len(missing) == 3:
        return None
    if missing:
        raise ValueError(f"trainer.mode=live: {', '.join(missing)} not set; the live launcher sets them for each "
                         "replica group (python -m pipesgd.train trainer.mode=live), or set them yourself")
    defaults = LiveOptions("-", "-", 0)
    return LiveOptions(lighthouse=os.environ[ENV_LIGHTHOUSE], run_id=os.environ[ENV_RUN_ID],
                       replica=int(os.environ[ENV_REPLICA]), host=os.environ.get(ENV_HOST, LOOPBACK),
                       timeout_s=float(os.environ.get(ENV_TIMEOUT, defaults.timeout_s)),
                       quorum_timeout_s=float(os.environ.get(ENV_QUORUM_TIMEOUT, defaults.quorum_timeout_s)),
                       min_replicas=int(os.environ.get(ENV_MIN_REPLICAS, defaults.min_replicas)),
                       init_sync=os.environ.get(ENV_INIT_SYNC, str(int(defaults.init_sync))) == "1",
                       start_replicas=int(os.environ[ENV_START_REPLICAS]) if os.environ.get(ENV_START_REPLICAS)
                       else None,
                       start_timeout_s=float(os.environ[ENV_START_TIMEOUT]) if os.environ.get(ENV_START_TIMEOUT)
                       else None)
