"""Who the training loop's own collectives run with: the BatchNorm buffers and the recent training
losses each evaluation averages, and the evaluation's sums (:class:`Peers`). By default every rank
of torch.distributed's default group (:class:`RankPeers`); under ``trainer.mode=live`` the replica
groups of the current quorum (:class:`pipesgd.live.peers.QuorumPeers`), where a group may die
mid-collective and the others must not wait for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


class Peers(Protocol):
    """``shares_evaluation``: each replica scores its own share of the test set (the eval loader
    it was given) and :meth:`sum` adds the shares; False where each scores the whole set and its
    own sums are the result."""

    shares_evaluation: bool

    def average(self, tensors: list[Tensor], what: str) -> int:
        """Replace each of ``tensors`` by its mean over the replicas that take part and return how
        many did; 1 where this replica is alone (or, under live recovery, could not reach the
        others: then its values are left as they were and it logs why)."""

    def sum(self, tensor: Tensor, what: str) -> None:
        """Sum ``tensor`` in place over every replica (only where ``shares_evaluation``)."""


class RankPeers:
    """Every rank of torch.distributed's default group (none in a lone process), in one order with
    the engine's own communication: ``collective`` is the engine's
    (:meth:`pipesgd.engine.base.Engine.collective`). A rank that fails fails the job, as every
    collective of these modes does (the launcher restarts it from a checkpoint)."""

    shares_evaluation = True

    def __init__(self, collective: Callable[[Callable[[], T], str], T]):
        self.collective = collective

    def average(self, tensors: list[Tensor], what: str) -> int:
        if not dist.is_initialized():
            return 1
        world = dist.get_world_size()

        def reduce() -> None:
            for t in tensors:
                dist.all_reduce(t)
                t /= world

        self.collective(reduce, what)
        return world

    def sum(self, tensor: Tensor, what: str) -> None:
        if dist.is_initialized():
            self.collective(lambda: dist.all_reduce(tensor), what)
