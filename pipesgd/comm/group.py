"""Which group an allreduce runs over: a registered ``torch.distributed`` group (None: the
default one), or a :class:`PeerGroup`, one torch.distributed does not know (torchft's
reconfigurable group, ``trainer.mode=live``), used through its own methods. The ring
(comm/ring.py) and the backend's allreduce (comm/native.py) read rank and size through here, at
the start of every reduction, so a group re-formed between two reductions is taken as it is then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch.distributed as dist
from torch import Tensor


class PeerGroup(ABC):
    """A process group that ``dist.*(group=...)`` and ``batch_isend_irecv`` cannot take, reached
    through its own send, receive and all_reduce. ``rank()`` and ``size()`` are read anew by
    each reduction (the group may have been re-formed since the last); ``backend``: what
    :func:`pipesgd.comm.bind` picks an allreduce for (``comm=auto``)."""

    backend: str = "gloo"

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def isend(self, tensor: Tensor, dst: int):
        """Start sending ``tensor`` to group rank ``dst``; a handle with ``wait()``."""

    @abstractmethod
    def irecv(self, tensor: Tensor, src: int):
        """Start receiving into ``tensor`` from group rank ``src``; a handle with ``wait()``."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor) -> None:
        """Sum ``tensor`` in place across the group; blocks until done (raises on a failure)."""

    @abstractmethod
    def all_gather(self, out: list[Tensor], tensor: Tensor) -> None:
        """Fill ``out`` (one tensor like ``tensor`` per rank) with every rank's ``tensor``, in
        rank order; blocks until done (raises on a failure)."""

    def describe(self, rank: int) -> str:
        """What logs and errors call group rank ``rank``."""
        return f"rank {rank}"


def group_size(group) -> int:
    """Processes in ``group`` (None: the default group)."""
    return group.size() if isinstance(group, PeerGroup) else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in ``group``."""
    return group.rank() if isinstance(group, PeerGroup) else dist.get_rank(group)


def peer_name(group, rank: int) -> str:
    """What logs and errors call ``group``'s rank ``rank``: its default-group rank, or what a
    :class:`PeerGroup` calls it."""
    if isinstance(group, PeerGroup):
        return group.describe(rank)
    return f"rank {rank if group is None else dist.get_global_rank(group, rank)}"


def all_gather(out: list[Tensor], tensor: Tensor, group) -> None:
    """Every rank's ``tensor`` of ``group`` into ``out``, in rank order (the backend's all_gather)."""
    if isinstance(group, PeerGroup):
        group.all_gather(out, tensor)
    else:
        dist.all_gather(out, tensor, group=group)


def all_reduce(tensor: Tensor, group) -> None:
    """Sum ``tensor`` in place across ``group`` with the backend's own all_reduce."""
    if isinstance(group, PeerGroup):
        group.all_reduce(tensor)
    else:
        dist.all_reduce(tensor, group=group)
