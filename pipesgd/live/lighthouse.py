"""The run's lighthouse: torchft's quorum server, in this process, listening only where asked."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import require_torchft
from .listen import bracketed
from .options import LOOPBACK

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LighthouseOptions:
    """``host``: the address to listen on (loopback by default; the cluster's own interface on
    several nodes; never every interface unless asked for with ``"0.0.0.0"``). ``port`` 0 picks a
    free one. ``min_replicas``: fewest replica groups a quorum may have (1: one survivor trains on).
    ``join_timeout_ms``: how long a quorum waits for the replicas it last had before forming
    without them; ``heartbeat_timeout_ms``: silence after which a replica counts as gone (the
    survivors' stall when one dies); ``quorum_tick_ms``: how often quorums are evaluated."""

    host: str = LOOPBACK
    port: int = 0
    min_replicas: int = 1
    join_timeout_ms: int = 1000
    heartbeat_timeout_ms: int = 1000
    quorum_tick_ms: int = 20

    def __post_init__(self):
        counts = {"min_replicas": self.min_replicas, "join_timeout_ms": self.join_timeout_ms,
                  "heartbeat_timeout_ms": self.heartbeat_timeout_ms, "quorum_tick_ms": self.quorum_tick_ms}
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"trainer.live.{name}={value!r} is invalid: must be an integer >= 1")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"trainer.live.lighthouse_port={self.port!r} is invalid: must be 0 (any free port) or a "
                             "port number")
        if not self.host:
            raise ValueError("trainer.live.host='' would listen on every interface; name the address (e.g. 127.0.0.1)")


class Lighthouse:
    """An in-process ``torchft.coordination.LighthouseServer``; ``address`` is what replicas dial
    (``http://host:port``). A context manager: leaving it shuts the server down. It is the run's single
    point of failure: replicas cannot form quorums without it (docs/reliability.md)."""

    def __init__(self, options: LighthouseOptions = LighthouseOptions()):
        require_torchft()
        from torchft.coordination import LighthouseServer

        self.options = options
        host = bracketed(options.host)
        self._server = LighthouseServer(bind=f"{host}:{options.port}", min_replicas=options.min_replicas,
                                        join_timeout_ms=options.join_timeout_ms,
                                        quorum_tick_ms=options.quorum_tick_ms,
                                        heartbeat_timeout_ms=options.heartbeat_timeout_ms)
        # torchft advertises the machine's hostname, which need not resolve to the bound address
        port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://{host}:{port}"
        log.info("lighthouse listening on %s (min_replicas=%d, heartbeat timeout %d ms)", self.address,
                 options.min_replicas, options.heartbeat_timeout_ms)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
