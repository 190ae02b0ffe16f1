"""GroupPeers, the loop's collectives where a torchft replica group is k ranks: inside the group over
torch.distributed's default group, across the groups by the quorum's peers (here a stand-in). Two Gloo
ranks of one group: the average and the sum reach both, and a sum across the groups that fails on one
rank leaves every rank its own slice's score, none waiting on the other."""

from __future__ import annotations

import pytest
import torch

from distributed_utils import run_workers


class _Quorum:
    """The groups' peers as QuorumPeers answers: ``groups`` of them averaged; ``fails``: the ranks
    whose sum across the groups fails."""

    def __init__(self, rank: int, fails: tuple[int, ...]):
        self.rank, self.fails = rank, fails

    def average(self, tensors, what):
        return 3

    def evaluation_share(self):
        return (1, 3)

    def sum(self, totals, what):
        if self.rank in self.fails:
            return False
        totals *= 3  # the other groups' shares, as if they scored the same
        return True


def _collectives(rank: int, world: int, fails: tuple[int, ...]):
    from pipesgd.live.peers import GroupPeers

    peers = GroupPeers(_Quorum(rank, fails))
    buffers = [torch.full((2,), float(rank + 1))]
    count = peers.average(buffers, "averaging")
    totals = torch.tensor([10.0 * (rank + 1), 1.0])
    done = peers.sum(totals, "summing")
    return count, buffers[0], peers.evaluation_share(), done, totals


@pytest.mark.timeout(60)
def test_group_peers_average_and_sum_inside_the_group_then_across_the_groups():
    for rank, (count, buffer, share, done, totals) in enumerate(run_workers(_collectives, 2, ())):
        assert count == 3 and torch.equal(buffer, torch.full((2,), 1.5)) and share == (1, 3)
        assert done and torch.equal(totals, torch.tensor([90.0, 6.0])), rank  # (10 + 20) * 3, (1 + 1) * 3


@pytest.mark.timeout(60)
def test_a_sum_across_the_groups_failing_on_one_rank_leaves_each_rank_its_own_slice():
    out = run_workers(_collectives, 2, (1,))
    assert out[0][3] and torch.equal(out[0][4], torch.tensor([30.0, 3.0]))  # its slice, every group's share
    assert not out[1][3] and torch.equal(out[1][4], torch.tensor([20.0, 1.0]))  # as it was: the caller scores the rest
