"""One point-to-point round trip, timed: the measurement behind α and β (pipesgd_lab.bench.calibrate)
and the emulated-link probe (pipesgd_lab.emulate.probe)."""

from __future__ import annotations

import time

import torch.distributed as dist
from torch import Tensor


def round_trip(buf: Tensor, peer: int, first: bool, group=None) -> float:
    """``first`` sends ``buf`` to ``peer`` and receives it back; the other side echoes it.

    Returns the seconds this side spent: the full round trip on the first side's clock (the
    echoing side's number includes its wait for the message and is not a round trip).
    """
    t0 = time.perf_counter()
    if first:
        dist.send(buf, peer, group=group)
        dist.recv(buf, peer, group=group)
    else:
        dist.recv(buf, peer, group=group)
        dist.send(buf, peer, group=group)
    return time.perf_counter() - t0
