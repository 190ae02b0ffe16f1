"""One hop of point-to-point messages, posted the way the group's backend wants them.

NCCL: every hop is one ``dist.batch_isend_irecv`` call. Its sends and receives become one NCCL
group on the group's own communicator, so a receive never waits behind a send on a shared stream
and no communicator is created lazily per rank pair (with p >= 3 each rank would first wait for its
left pair's setup, a cycle). The batch returns one handle for the whole hop.

Gloo (and any backend that does not coalesce): plain ``irecv`` then ``isend``, one handle each.
Gloo's ``batch_isend_irecv`` is the same loop with a ``P2POp`` built per message, so the direct
calls are kept: they are what the ring's Gloo timings were measured with.

A :class:`~pipesgd.comm.group.PeerGroup` (torchft's group) posts through its own ``irecv`` /
``isend``, receives first too.

The backend is read once per reduction (:func:`batched`), not per hop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from .group import PeerGroup


def backend_of(group=None) -> str:
    """The backend ``group`` (None: the default group) runs on; ``"gloo"`` without a process group."""
    if isinstance(group, PeerGroup):
        return group.backend
    return str(dist.get_backend(group)) if dist.is_available() and dist.is_initialized() else "gloo"


def uses_nccl(group) -> bool:
    """Whether NCCL is among ``group``'s backends (``"nccl"``, or ``"cpu:gloo,cuda:nccl"``)."""
    return dist.Backend.NCCL in str(dist.get_backend(group))


def batched(group) -> bool:
    """Whether hops on ``group`` go through ``batch_isend_irecv``: whenever NCCL may carry them (a
    Gloo hop in a batch is still right, only slower); never on a :class:`PeerGroup`."""
    return not isinstance(group, PeerGroup) and uses_nccl(group)


def post(recvs: Sequence[tuple[Tensor, int]], sends: Sequence[tuple[Tensor, int]], group,
         batch: bool) -> tuple[list, list]:
    """Post one hop: receive each ``(buffer, group rank)`` of ``recvs`` and send each of ``sends``.

    Returns ``(receive handles, send handles)``, one per message, in the order given; with
    ``batch`` every entry is one handle for the whole hop (waiting on it again is free). Receives
    are posted before sends (with Gloo, 1.9x faster at p = 2 than the other order, measured).
    """
    if batch:
        ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=src) for t, src in recvs]
        ops += [dist.P2POp(dist.isend, t, group=group, group_peer=dst) for t, dst in sends]
        hop = _Hop(dist.batch_isend_irecv(ops) if ops else [])
        return [hop] * len(recvs), [hop] * len(sends)
    if isinstance(group, PeerGroup):
        return [group.irecv(t, src) for t, src in recvs], [group.isend(t, dst) for t, dst in sends]
    rreqs = [dist.irecv(t, group=group, group_src=src) for t, src in recvs]
    sreqs = [dist.isend(t, group=group, group_dst=dst) for t, dst in sends]
    return rreqs, sreqs


class _Hop:
    """The handles ``batch_isend_irecv`` returned (one when the backend coalesces), waited as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
