"""A reduction that a hung peer cannot hold past the lighthouse's heartbeat timeout
(pipesgd.live.watch), and what the lighthouse's status page says about who still heartbeats
(pipesgd.live.status), read from a real in-process lighthouse. The whole path, a group SIGSTOPped
with a hop in flight: tests/distributed/test_live.py::test_a_hung_group_holds_the_survivor_only_until_the_lighthouse_stops_hearing_it."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch

from needs_torchft import require_torchft

require_torchft()

from pipesgd.live import status, watch  # noqa: E402
from pipesgd.live.group import TorchftGroup  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402


def _never(*_):
    raise AssertionError("the lighthouse was asked about a reduction that ended within its grace")


@pytest.mark.timeout(30)
def test_a_reduction_that_ends_returns_its_value_or_raises_its_error_without_asking_the_lighthouse():
    left = []
    assert watch.watched(lambda: 42, _never, "r", left, grace_s=10) == 42

    def failing():
        raise ConnectionResetError("hop 1/2: Connection reset by peer")

    with pytest.raises(ConnectionResetError, match="Connection reset by peer"):
        watch.watched(failing, _never, "r", left, grace_s=10)
    assert left == []


@pytest.mark.timeout(30)
def test_a_reduction_held_by_a_silent_peer_is_given_up_and_its_thread_left_behind():
    release, finished, asked = threading.Event(), threading.Event(), []

    def hop():  # a hop to a stopped peer: it returns only when the peer answers
        release.wait()
        finished.set()
        return "late"

    def silent():
        asked.append(1)
        return [1] if len(asked) >= 3 else []

    left = []
    with pytest.raises(watch.PeerSilent) as err:
        watch.watched(hop, silent, "the reduction launched at step 40", left, grace_s=0, poll_s=0.01)
    assert len(asked) == 3 and not finished.is_set() and len(left) == 1 and left[0].is_alive()
    assert str(err.value).startswith("the reduction launched at step 40 given up: replica group 1 stopped "
                                     "heartbeating to the lighthouse")
    release.set()  # the peer answers later: the thread ends on its own, its result goes nowhere
    assert watch.join_left(left, 10) == [] and finished.is_set()


@pytest.mark.timeout(30)
def test_closing_waits_for_a_reduction_given_up_and_names_one_that_outlives_the_wait(caplog):
    """A thread left inside Gloo when the interpreter finalizes aborts the process: close() waits
    for the reductions given up (Gloo's timeout ends them), and says so when one outlives the wait."""
    never = threading.Event()
    left = []
    with pytest.raises(watch.PeerSilent):
        watch.watched(never.wait, lambda: [2], "r", left, grace_s=0, poll_s=0.01)
    with caplog.at_level(logging.WARNING, logger="pipesgd.live.watch"):
        assert watch.join_left(left, 0.05) == left
    assert "1 reduction(s) given up on a silent peer still wait in Gloo after 0 s" in caplog.text
    never.set()
    assert watch.join_left(left, 10) == []


@pytest.mark.timeout(30)
def test_a_lighthouse_out_of_reach_is_logged_once_and_the_reduction_waited_for(caplog):
    release = threading.Event()

    def unreachable():
        if len(caplog.records) >= 1:
            release.set()
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    with caplog.at_level(logging.WARNING, logger="pipesgd.live.watch"):
        assert watch.watched(lambda: release.wait() and "done", unreachable, "r", [], grace_s=0,
                             poll_s=0.01) == "done"
    assert [r.getMessage() for r in caplog.records] == [
        "cannot ask the lighthouse which groups still heartbeat ([Errno 111] Connection refused): r waits for its "
        "peers or trainer.live.timeout_s"]


@pytest.mark.timeout(60)
def test_the_status_page_tells_a_silent_group_from_one_that_heartbeats_and_a_restarted_one():
    from torchft.coordination import LighthouseClient

    # 2 s, not less: each "heard" assertion below needs its heartbeats younger than the timeout when
    # the page is read, and a loaded 2-core runner once paused this test longer than 200 ms between them
    with Lighthouse(LighthouseOptions(heartbeat_timeout_ms=2000)) as lighthouse:
        client = LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=10))
        alive, hung, old, restarted = (f"run7_{g}:{uuid.uuid4()}" for g in (0, 1, 2, 2))
        for replica_id in (alive, hung, old, "other_1:x"):
            client.heartbeat(replica_id)
        assert status.silent(lighthouse.address, "run7", [0, 1, 2, 3]) == [3]  # never heard
        deadline = time.monotonic() + 20
        while status.silent(lighthouse.address, "run7", [0, 1, 2]) != [1, 2]:  # 0 keeps heartbeating
            assert time.monotonic() < deadline, status.heartbeats(lighthouse.address)
            client.heartbeat(alive)
        page = status.heartbeats(lighthouse.address)
        assert page[hung] is False and page[old] is False and page["other_1:x"] is False
        for replica_id in (alive, restarted):  # group 2's new process: its old one stays listed, old
            client.heartbeat(replica_id)
        assert status.silent(lighthouse.address, "run7", [0, 2]) == []
        assert status.heartbeats(lighthouse.address)[old] is False


def test_a_replica_id_names_its_group_only_in_its_own_run():
    assert status.group_of("exp7", "exp7_3:5f0c") == 3 and status.group_of("exp7", "exp7_3") == 3
    assert status.group_of("exp7", "exp7x_3:5f0c") is None and status.group_of("exp7", "exp7_x:1") is None
    assert status.groups_of("exp7", ["exp7_0:a", "exp7_0:b", "other_1:c", "exp7_2:d"]) == {0, 2}


class _Wrapper:
    """torchft 0.2.0's ProcessGroupGloo as its last configure left it: the quorum's global ranks
    (group number times the group's size plus the group rank), and the current c10d group."""

    def __init__(self, ranks, parent):
        self._global_ranks, self._group_world_size, self._group_rank, self.parent = ranks, 1, 0, parent


def test_a_reduction_binds_the_quorum_it_started_in():
    first, second = object(), object()
    pg = _Wrapper([0, 2], first)
    group = TorchftGroup(pg)
    bound = group.bound()
    pg.parent, pg._global_ranks = second, [0]  # the Manager re-forms the group for the next quorum
    assert bound.pg is first and bound.groups == [0, 2] and bound.peers(0) == [2]
    assert group.bound().pg is second and group.bound().groups == [0] and group.bound().peers(0) == []
    unformed = TorchftGroup(_Wrapper(None, first)).bound()  # not configured by a Manager yet
    assert unformed.groups is None and unformed.peers(0) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("silent", [False, True])
def test_a_watched_stateful_reduction_works_on_a_copy_kept_only_when_it_ends(monkeypatch, silent):
    """A reduction with state (a residual) given up goes on in the background: it must change a
    copy, never the state the engine's next reduction reads; one that ends hands its copy over."""
    from pipesgd.live import engine as live
    from pipesgd.live.group import QuorumGroup
    from pipesgd.live.options import LiveOptions

    class Stateful:  # what top-k, PowerSGD and error feedback keep from step to step
        def __init__(self):
            self.residual = torch.zeros(3)

    release = threading.Event()
    engine = live.LiveEngine.__new__(live.LiveEngine)  # the parts _reduce_watched reads, no torchft
    engine.options, engine.reduction, engine._left = LiveOptions("http://lighthouse", "run", 0), Stateful(), []
    before = engine.reduction

    def reduce(buf, group, reduction):
        if silent:
            release.wait()  # the hop to the silent group: it returns only when that group answers
        reduction.residual += 1
        return live.CommStats()

    engine._reduce = reduce
    monkeypatch.setattr(live.status, "silent", lambda *_: [1] if silent else [])
    group = QuorumGroup(None, [0, 1])
    if not silent:
        engine._reduce_watched(torch.zeros(3), group, [1], 7)
        assert engine.reduction is not before and engine.reduction.residual.tolist() == [1, 1, 1]
        assert before.residual.tolist() == [0, 0, 0]
        return
    with pytest.raises(watch.PeerSilent, match="the reduction launched at step 7 given up: replica group 1"):
        engine._reduce_watched(torch.zeros(3), group, [1], 7)
    release.set()  # the silent group answers late: the thread given up finishes its reduction
    assert watch.join_left(engine._left, 10) == []
    assert engine.reduction is before and before.residual.tolist() == [0, 0, 0]
