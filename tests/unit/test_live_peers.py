"""QuorumPeers' decisions, with a fake quorum (pipesgd.live.peers; the processes, a real torchft
group and a group killed mid-evaluation: tests/distributed/test_live_metrics.py): the average runs
only where every group of the quorum participates, shares the test set only where the groups hold
one committed step, and a failure leaves this group's own values and is reported to the Manager."""

from __future__ import annotations

import logging

import pytest
import torch

from pipesgd.comm import CommThread
from pipesgd.live.peers import QuorumPeers


class FakeManager:
    def __init__(self, participants: int, participating: bool = True, step: int = 7):
        self.participants, self.participating, self.step = participants, participating, step
        self.errors: list[Exception] = []

    def wait_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def current_step(self) -> int:
        return self.step

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


class FakeGroup:
    """Rank 1 of ``size``; its all_reduce adds ``other`` (the other group's buffer), or raises it."""

    def __init__(self, size: int, other):
        self.sizes, self.other, self.calls = size, other, 0

    def size(self) -> int:
        return self.sizes

    def rank(self) -> int:
        return 1

    def all_reduce(self, t: torch.Tensor) -> None:
        self.calls += 1
        if isinstance(self.other, Exception):
            raise self.other
        t += self.other(t)


@pytest.fixture
def thread():
    t = CommThread("test-live-peers")
    yield t
    t.close()


def _peers(thread, manager, group) -> QuorumPeers:
    return QuorumPeers(manager, group, thread, wait_s=30)


def _other(values: list[float], step: int):
    """What the other group adds: to an average, its values, count 1, its step and its square; to
    the sums of the scores (three values), sums equal to this group's."""
    return lambda t: torch.tensor(values + [1.0, step, step * step], dtype=torch.float64) if t.numel() > 3 else t


def test_groups_at_one_step_average_and_share_the_test_set(thread):
    group = FakeGroup(2, _other([3.0, 5.0], step=7))
    peers = _peers(thread, FakeManager(2), group)
    buf, loss = torch.tensor([1.0], dtype=torch.float32), torch.tensor([1.0], dtype=torch.float64)
    assert peers.average([buf, loss], "averaging") == 2
    assert buf.item() == 2.0 and loss.item() == 3.0
    assert peers.evaluation_share() == (1, 2)
    totals = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert peers.sum(totals, "summing") and totals.tolist() == [2.0, 4.0, 6.0]


def test_groups_at_different_steps_average_but_each_scores_the_whole_set(thread, caplog):
    peers = _peers(thread, FakeManager(2), FakeGroup(2, _other([3.0], step=6)))
    buf = torch.tensor([1.0], dtype=torch.float64)
    with caplog.at_level(logging.WARNING, "pipesgd.live.peers"):
        assert peers.average([buf], "averaging") == 2
    assert buf.item() == 2.0 and peers.evaluation_share() is None
    assert "hold different committed steps" in caplog.text
    totals = torch.ones(3, dtype=torch.float64)
    assert peers.sum(totals, "summing") and totals.tolist() == [1.0, 1.0, 1.0], "nothing added to a whole-set score"


@pytest.mark.parametrize("manager", [FakeManager(1), FakeManager(2, participating=False)],
                         ids=["a peer heals", "this group heals"])
def test_a_quorum_with_a_healer_averages_nothing_and_reports_no_error(thread, manager, caplog):
    group = FakeGroup(2, _other([3.0], step=7))
    buf = torch.tensor([1.0], dtype=torch.float64)
    with caplog.at_level(logging.WARNING, "pipesgd.live.peers"):
        assert _peers(thread, manager, group).average([buf], "averaging") == 1
    assert buf.item() == 1.0 and group.calls == 0 and not manager.errors
    assert "groups in the quorum hold its step (the others heal)" in caplog.text


def test_a_failed_average_or_sum_keeps_the_own_values_and_is_reported(thread):
    manager = FakeManager(2)
    dead = RuntimeError("Connection closed by peer")
    buf = torch.tensor([1.0], dtype=torch.float64)
    assert _peers(thread, manager, FakeGroup(2, dead)).average([buf], "averaging") == 1
    assert buf.item() == 1.0 and manager.errors == [dead]
    group = FakeGroup(2, _other([3.0], step=7))
    peers = _peers(thread, manager, group)
    assert peers.average([buf], "averaging") == 2 and peers.evaluation_share() == (1, 2)
    group.other = dead  # the other group dies while the two score their shares
    totals = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert not peers.sum(totals, "summing") and totals.tolist() == [1.0, 2.0, 3.0]
    assert manager.errors == [dead, dead]
    assert thread.submit(lambda: "still serving").wait(5) == "still serving", "the thread is not poisoned"
