"""torchft's reconfigurable process group as the group pipesgd's allreduces run over
(:class:`~pipesgd.comm.group.PeerGroup`): it is not registered with torch.distributed, so the ring's
hops, the backend's all_reduce and top-k's all_gather go through the group's own ``send`` /
``recv`` / ``allreduce`` / ``allgather``."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from ..comm.group import PeerGroup

TAG = 0  # one tag for every message: Gloo matches the messages between one pair of ranks in order


class TorchftGroup(PeerGroup):
    """``pg``: a ``torchft.process_group.ProcessGroupGloo`` the Manager re-forms at each quorum
    (``configure``: a new Gloo group of the quorum's replica groups, this one at its replica rank).
    Rank and size are the group's as it is now: read them after the quorum a reduction waits for.
    The wrapper's own ``rank()`` is not that (torchft 0.2.0 builds the wrapper at rank 0 of 1 and
    leaves it so); its ``parent``, the group of the current quorum, has both. A group whose
    configuration failed has no parent: AssertionError, which the caller reports as a failure."""

    def __init__(self, pg):
        self.pg = pg

    def rank(self) -> int:
        return self.pg.parent.rank()

    def size(self) -> int:
        return self.pg.parent.size()

    def isend(self, tensor: Tensor, dst: int):
        return self.pg.send([tensor], dst, TAG)

    def irecv(self, tensor: Tensor, src: int):
        return self.pg.recv([tensor], src, TAG)

    def all_reduce(self, tensor: Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self.pg.allreduce([tensor], opts).wait()

    def all_gather(self, out: list[Tensor], tensor: Tensor) -> None:
        self.pg.allgather([out], [tensor], AllgatherOptions()).wait()

    def describe(self, rank: int) -> str:
        return f"replica rank {rank} of the quorum"
