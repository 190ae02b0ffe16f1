"""The live replica check, riding on the live engine's reduction: every ``check_every`` committed
updates (torchft's step, which every group of a quorum holds) the reduction carries, after its
count, each byte d of the sha256 of the weights it was launched from and d*d, summed exactly with
the count; the sums tell whether the digests of the groups that took part differ
(:func:`pipesgd.reliability.replicas.moments`). No collective of its own: live replica groups share
no process group to gather digests on. docs/reliability.md, "Live recovery", says what it catches.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from ..reliability.replicas import EXACT_GROUPS, ReplicaMismatch, describe_summed_mismatch, moments

log = logging.getLogger(__name__)


class Rider(NamedTuple):
    """A replica check a reduction carries: the weights after ``update`` committed updates (the
    quorum's step), launched at this group's ``step``; ``mine``, this group's digest if it took part."""

    update: int
    step: int
    mine: str | None


def due(every: int | None, update: int) -> bool:
    """Whether the reduction launched after ``update`` committed updates carries a check (one every
    ``every``; None: never). Read from the quorum's step, so every group of a quorum agrees."""
    return every is not None and update > 0 and update % every == 0


def carry(sums: Tensor, digest: str) -> None:
    """Write ``digest``'s moments into ``sums`` (the buffer's slots after its tail), times this
    share's count, 1."""
    sums[:] = torch.tensor(moments(digest), dtype=sums.dtype)


def verify(rider: Rider, count: float, sums: Tensor, every: int) -> bool:
    """The check a committed reduction carried, read from its summed ``sums`` and ``count``:
    ReplicaMismatch if the digests of the groups that took part differ (every group of the quorum
    reads the same sums). Returns whether it compared this group's weights with another group's."""
    groups = int(count)
    if groups > EXACT_GROUPS:  # the sums of squares would round
        log.warning("replica check of update %d not made: %d groups, more than the %d whose sums are exact",
                    rider.update, groups, EXACT_GROUPS)
        return False
    problem = describe_summed_mismatch(groups, sums.tolist(), rider.mine,
                                       f"update {rider.update} (this group's step {rider.step})")
    if problem:
        raise ReplicaMismatch(problem + f" (the live replica check, every {every} committed updates: "
                              "trainer.check_every; every group applies the same averaged updates, so this is a "
                              "group that changed its weights outside engine.step(), memory corruption, a bug or "
                              "non-deterministic hardware)")
    return groups >= 2 and rider.mine is not None
