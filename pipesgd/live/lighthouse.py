"""The run's lighthouse: torchft's quorum server, in this process, listening only where asked.

``python -m pipesgd.live.lighthouse --host ADDR [--port P] [...]``: the lighthouse of a run whose
replica groups are started on their own (a torchrun job per group, docs/multi-node.md), until
SIGTERM or Ctrl-C; it prints the address the groups are given (``trainer.live.lighthouse``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an integer >= 1")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) >= 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be 0 (any free port) or a port number")
    return int(text)


def _host(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("'' would listen on every interface; name the address (e.g. 127.0.0.1)")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    d = LighthouseOptions()
    p = argparse.ArgumentParser(
        prog="python -m pipesgd.live.lighthouse",
        description="The lighthouse of a live run (trainer.mode=live) whose replica groups are started on their own, "
                    "e.g. a torchrun job per group (docs/multi-node.md): torchft's quorum server, listening on --host "
                    "only, until SIGTERM or Ctrl-C. Prints its address (give it to every group as "
                    "trainer.live.lighthouse) on stdout.")
    p.add_argument("--host", type=_host, default=d.host,
                   help=f"the address to listen on, one every node reaches (default {d.host})")
    p.add_argument("--port", type=_port, default=d.port, help="the port; 0 picks a free one (default 0)")
    p.add_argument("--min-replicas", type=_count, default=d.min_replicas,
                   help=f"fewest replica groups a quorum may have (default {d.min_replicas})")
    p.add_argument("--join-timeout-ms", type=_count, default=d.join_timeout_ms,
                   help=f"how long a quorum waits for the groups it last had (default {d.join_timeout_ms})")
    p.add_argument("--heartbeat-timeout-ms", type=_count, default=d.heartbeat_timeout_ms,
                   help=f"silence after which a group counts as gone (default {d.heartbeat_timeout_ms})")
    p.add_argument("--quorum-tick-ms", type=_count, default=d.quorum_tick_ms,
                   help=f"how often quorums are evaluated (default {d.quorum_tick_ms})")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's server logs every quorum tick at info
    options = LighthouseOptions(host=a.host, port=a.port, min_replicas=a.min_replicas,
                                join_timeout_ms=a.join_timeout_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms,
                                quorum_tick_ms=a.quorum_tick_ms)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    with Lighthouse(options) as lighthouse:
        print(lighthouse.address, flush=True)
        while not stop.wait(1.0):
            pass
    log.info("lighthouse at %s stopped", lighthouse.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
