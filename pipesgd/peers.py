"""Who the training loop's own collectives run with: the BatchNorm buffers and the recent training
losses each evaluation averages, and the sums of its scores (:class:`Peers`). By default every rank
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
    """One evaluation's collectives, called in this order: :meth:`average`, then the test set
    scored (the eval loader as given, or the share :meth:`evaluation_share` names), then :meth:`sum`."""

    def average(self, tensors: list[Tensor], what: str) -> int:
        """Replace each of ``tensors`` by its mean over the replicas that take part and return how
        many did; 1 where this replica is alone (or, under live recovery, could not reach the
        others: then its values are left as they were and it logs why)."""

    def evaluation_share(self) -> tuple[int, int] | None:
        """``(index, count)``: score share ``index`` of ``count`` of the eval loader's samples
        (:meth:`pipesgd.data.loader.EvalLoader.share`) and let :meth:`sum` add the others'; None:
        score the eval loader as given."""

    def sum(self, totals: Tensor, what: str) -> bool:
        """Add the other replicas' scores to ``totals`` in place; False where they could not be
        had (``totals`` as it was, the failure logged): this replica then scores the other shares
        of :meth:`evaluation_share` itself."""


class RankPeers:
    """Every rank of torch.distributed's default group (none in a lone process), in one order with
    the engine's own communication: ``collective`` is the engine's
    (:meth:`pipesgd.engine.base.Engine.collective`). A rank that fails fails the job, as every
    collective of these modes does (the launcher restarts it from a checkpoint)."""

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

    def evaluation_share(self) -> None:
        return None  # the eval loader is this rank's slice already

    def sum(self, totals: Tensor, what: str) -> bool:
        if dist.is_initialized():
            self.collective(lambda: dist.all_reduce(totals), what)
        return True
