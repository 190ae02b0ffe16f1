"""The start barrier of replica groups started on their own (trainer.live.start_replicas,
pipesgd.live.barrier): it counts the groups of its run the lighthouse has heard from, read from a
real in-process lighthouse, another run's groups left out; past its limit it fails naming the
option and its value. The groups under torchrun: tests/e2e/test_live_torchrun_start.py."""

from __future__ import annotations

import http.server
import threading
import uuid
from datetime import timedelta

import pytest

from needs_torchft import require_torchft

require_torchft()

from pipesgd.live import barrier, status  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse  # noqa: E402


def _heartbeat(lighthouse: Lighthouse, replica_id: str) -> None:
    """A heartbeat as a group's Manager sends it (torchft appends a uuid to the group's name)."""
    from torchft.coordination import LighthouseClient

    LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=10)).heartbeat(
        f"{replica_id}:{uuid.uuid4()}")


@pytest.mark.timeout(60)
def test_the_barrier_counts_only_its_runs_groups_and_names_the_option_when_it_gives_up():
    with Lighthouse() as lighthouse:
        for replica_id in ("exp7_0", "exp7_0", "other_1", "exp7x_1", "exp7_x"):  # group 0 twice: a restart
            _heartbeat(lighthouse, replica_id)
        assert status.groups_of("exp7", status.heartbeating(lighthouse.address)) == {0}
        with pytest.raises(TimeoutError) as err:
            barrier.wait_for_groups(lighthouse.address, "exp7", 2, 0.3)
        assert ("trainer.live.start_replicas=2: the lighthouse at " in str(err.value)
                and "heard from 1 replica group(s) of run 'exp7' ([0]) within trainer.live.start_timeout_s=0.3 s"
                in str(err.value))
        _heartbeat(lighthouse, "exp7_1")
        assert barrier.wait_for_groups(lighthouse.address, "exp7", 2, 0.3) == {0, 1}


@pytest.mark.timeout(60)
def test_a_live_engines_manager_is_heard_as_its_group(tmp_path):
    import torch

    from pipesgd.live.engine import LiveEngine
    from pipesgd.live.options import LiveOptions

    with Lighthouse() as lighthouse:
        model = torch.nn.Linear(2, 1)
        engine = LiveEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            LiveOptions(lighthouse.address, "barrier-run", 3, timeout_s=5, quorum_timeout_s=10))
        try:  # its Manager heartbeats from its construction on
            assert barrier.wait_for_groups(lighthouse.address, "barrier-run", 1, 10.0) == {3}
        finally:
            engine.close()


class _NotALighthouse(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html>a status page of another shape</html>")

    def log_message(self, *args):
        pass


@pytest.mark.timeout(30)
def test_a_status_page_of_another_shape_is_refused_naming_torchfts_version():
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotALighthouse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match=r"lists no heartbeats on its status page \(torchft .*"
                                               r"install torchft==0\.2\.0"):
            status.heartbeating(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
