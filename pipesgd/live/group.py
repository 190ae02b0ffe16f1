"""torchft's reconfigurable process group as the group pipesgd's allreduces run over
(:class:`~pipesgd.comm.group.PeerGroup`): it is not registered with torch.distributed, so the ring's
hops, the backend's all_reduce and top-k's all_gather go through the group's own ``send`` /
``recv`` / ``allreduce`` / ``allgather``."""

from __future__ import annotations

from abc import abstractmethod

from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from ..comm.group import PeerGroup

TAG = 0  # one tag for every message: Gloo matches the messages between one pair of ranks in order


class _GlooGroup(PeerGroup):
    """A PeerGroup over a c10d Gloo group, the one :meth:`_pg` returns at each call."""

    @abstractmethod
    def _pg(self): ...

    def rank(self) -> int:
        return self._pg().rank()

    def size(self) -> int:
        return self._pg().size()

    def isend(self, tensor: Tensor, dst: int):
        return self._pg().send([tensor], dst, TAG)

    def irecv(self, tensor: Tensor, src: int):
        return self._pg().recv([tensor], src, TAG)

    def all_reduce(self, tensor: Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._pg().allreduce([tensor], opts).wait()

    def all_gather(self, out: list[Tensor], tensor: Tensor) -> None:
        self._pg().allgather([out], [tensor], AllgatherOptions()).wait()

    def describe(self, rank: int) -> str:
        return f"replica rank {rank} of the quorum"


class TorchftGroup(_GlooGroup):
    """``pg``: a ``torchft.process_group.ProcessGroupGloo`` the Manager re-forms at each quorum
    (``configure``: a new Gloo group of the quorum's replica groups, this one at its replica rank).
    Rank and size are the group's as it is now: read them after the quorum a reduction waits for.
    The wrapper's own ``rank()`` is not that (torchft 0.2.0 builds the wrapper at rank 0 of 1 and
    leaves it so); its ``parent``, the group of the current quorum, has both. A group whose
    configuration failed has no parent: AssertionError, which the caller reports as a failure."""

    def __init__(self, pg):
        self.pg = pg

    def _pg(self):
        return self.pg.parent

    def bound(self) -> QuorumGroup:
        """The group of the current quorum, for one reduction: its hops stay on that quorum's Gloo
        group even after the Manager re-forms this one (a reduction given up by
        :func:`pipesgd.live.watch.watched` goes on in the background, and must never send on the
        next quorum's group, whose messages Gloo would match to it)."""
        ranks, groups = self.pg._global_ranks, None  # as torchft 0.2.0's wrapper keeps them from configure
        if ranks is not None:
            size, rank = self.pg._group_world_size or 1, self.pg._group_rank or 0
            groups = [(r - rank) // size for r in ranks]
        return QuorumGroup(self.pg.parent, groups)


class QuorumGroup(_GlooGroup):
    """One quorum's Gloo group (torchft's wrapper's ``parent`` when a reduction started) for that
    reduction; ``groups``: the replica groups in it, by number (None: not known, a group no
    Manager configured)."""

    def __init__(self, pg, groups: list[int] | None):
        self.pg, self.groups = pg, groups

    def _pg(self):
        return self.pg

    def peers(self, me: int) -> list[int]:
        """The quorum's replica groups other than ``me`` (none where the groups are not known)."""
        return [g for g in self.groups or () if g != me]
