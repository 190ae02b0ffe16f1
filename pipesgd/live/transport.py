"""Live state transfer between the replicas of one run: torchft's ``CheckpointTransport`` contract
over HTTP, listening only on the run's address, serving only peers that name the run's id.

torchft's own HTTP transport listens on every interface and serves whoever asks; this one binds
``host``, answers a request whose run id differs with 403 (logged), and a healer checks that the
state it received is its own run's. Imports torchft: only the live mode imports this module.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from . import require_torchft
from .listen import bracketed

require_torchft()
from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402

log = logging.getLogger(__name__)


class StrangerRefused(RuntimeError):
    """A peer that is not of this run asked for this run's state, or served another run's."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, handler):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), handler)


class RunTransport(CheckpointTransport):
    """Serves this replica's state at ``http://host:port/<run_id>/<step>`` between
    ``send_checkpoint`` and ``disallow_checkpoint`` (torchft calls both); a request for another
    run id, or for a step not staged, is refused. The staged state is serialized once, on the
    thread that stages it, so later changes to the live tensors cannot tear it."""

    def __init__(self, run_id: str, host: str, timeout: timedelta):
        if not run_id or "/" in run_id:
            raise ValueError(f"live.run_id={run_id!r}: must be non-empty and without '/'")
        self.run_id, self.host, self.timeout = run_id, host, timeout
        self.refused = 0  # strangers turned away (tests and the summary read it)
        self._staged_changed = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
        self._server = _Server(host, self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="pipesgd-live-transport",
                                        daemon=True)
        self._thread.start()

    def _handler(self):
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport.timeout.total_seconds()

            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != transport.run_id:
                    transport.refused += 1
                    log.warning("refused a request for %r from %s: not a peer of run %r", self.path,
                                self.client_address[0], transport.run_id)
                    self.send_error(403, f"not run {transport.run_id}")
                    return
                staged = transport._wait_for(parts[1])
                if staged is None:
                    self.send_error(404, f"no state staged for step {parts[1]}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(staged[1])))
                self.end_headers()
                self.wfile.write(staged[1])

            def log_message(self, format: str, *args) -> None:
                log.debug("transport: " + format, *args)

        return Handler

    @property
    def address(self) -> str:
        return f"http://{bracketed(self.host)}:{self._server.server_address[1]}/{self.run_id}/"

    def metadata(self) -> str:
        return self.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        data = io.BytesIO()
        torch.save({"run_id": self.run_id, "state": state_dict}, data)
        with self._staged_changed:
            self._staged = (step, data.getvalue())
            self._staged_changed.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._staged_changed:
            self._staged = None

    def _wait_for(self, step: str) -> tuple[int, bytes] | None:
        """The state staged for ``step``, waiting up to the timeout for it: a healer asks as soon
        as the quorum names its donor, and the donor stages its state at its next step boundary."""
        with self._staged_changed:
            self._staged_changed.wait_for(lambda: self._staged is not None and str(self._staged[0]) == step,
                                          self.timeout.total_seconds())
            staged = self._staged
        return staged if staged is not None and str(staged[0]) == step else None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        if not metadata.endswith(f"/{self.run_id}/"):
            raise StrangerRefused(f"asked to heal from {metadata}, which is not a peer of run {self.run_id!r}")
        try:
            with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as f:
                payload = torch.load(io.BytesIO(f.read()), weights_only=False)
        except urllib.error.HTTPError as e:
            raise StrangerRefused(f"{metadata}{step} refused run {self.run_id!r}: {e.code} {e.reason}") from e
        if payload.get("run_id") != self.run_id:
            raise StrangerRefused(f"{metadata} served run {payload.get('run_id')!r}, not {self.run_id!r}")
        return payload["state"]

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
