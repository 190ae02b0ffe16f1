"""The two levels of replicas of k ranks (``dist.ranks_per_replica``) in the period-H engine:
inside a replica, every inner step is synchronous data parallelism over its ranks (a width-1
PipeSGD over the replica's group, uncompressed, on the backend's allreduce: the fast fabric);
between replicas, a round's pseudo-gradient is exchanged by rank peers in k shards
(:class:`~pipesgd.reduction.sharded.Sharded`), so the slow link carries each replica's
pseudo-gradient once. docs/period-h.md, "Replicas of k ranks".
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from ..comm import CommStats, bind, get_allreduce
from ..comm.p2p import backend_of
from ..compress import Compressor
from ..dist import ReplicaGroups
from ..reduction import Reduction, resolve
from ..reduction.sharded import Sharded
from .base import NonFinitePolicy, StepStats
from .pipe import PipeSGD

log = logging.getLogger(__name__)


def sharded_exchange(compressor: str | Compressor | Reduction | None, allreduce: str | Callable[..., CommStats],
                     replicas: ReplicaGroups) -> tuple[Sharded, Callable[..., CommStats]]:
    """What a fragment's pipe exchanges over the rank peers' group: this rank's shard of the
    pseudo-gradient, carried by ``compressor`` in ``allreduce`` (comm=auto's pick made here, for the
    compressor itself and the peers' backend), the summed shards gathered inside the replica."""
    resolved = resolve(compressor)
    fn = get_allreduce(allreduce) if isinstance(allreduce, str) else allreduce
    bound = bind(fn, resolved, backend_of(replicas.peers))
    return Sharded(resolved, replicas.gather, replicas.k, replicas.member), bound


class _RoundDecides(NonFinitePolicy):
    """An inner step whose average over the replica is non-finite is not applied (the replica's
    weights stay finite) and the round it is in is marked non-finite: its pseudo-gradient is then
    dropped on every rank where its average lands, where ``trainer.nonfinite`` decides, as it
    does for a replica of one rank (whose non-finite steps make its pseudo-gradient non-finite)."""

    def __init__(self) -> None:
        super().__init__("skip", max_in_a_row=sys.maxsize)

    def bad(self, step: int, where: str) -> None:
        self.skipped.append(step)
        log.warning("non-finite gradient at inner step %d of this replica (%s): not applied; the round it is in "
                    "is dropped on every rank where its average lands (trainer.nonfinite decides there)", step, where)


class InnerSteps:
    """A replica's inner steps: each step's gradient averaged over ``group`` (the replica's k
    ranks) and stepped by ``optimizer``, so the replica trains as one rank with k times the
    batch; a step whose average is non-finite is not applied (``StepStats.skipped``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor], group, timeout_s: float | None):
        self.pipe = PipeSGD(optimizer, params, width=1, compressor="none", allreduce="native", group=group,
                            nonfinite="skip", timeout_s=timeout_s)
        self.pipe.nonfinite = _RoundDecides()
        self.sent_bytes = 0  # what this rank has sent inside its replica for the inner steps

    def step(self) -> StepStats:
        stats = self.pipe.step()
        self.sent_bytes += stats.comm.wire_bytes
        return stats

    def check_replicas(self) -> None:
        """The ranks of the replica hold the same weights (raises ReplicaMismatch on every one)."""
        self.pipe.check_replicas()

    def state_dict(self) -> dict:
        return {**self.pipe.state_dict(), "sent_bytes": self.sent_bytes}

    def load_state_dict(self, state: dict) -> None:
        self.pipe.load_state_dict(state)
        self.sent_bytes = int(state.get("sent_bytes", 0))

    def close(self) -> None:
        self.pipe.close()
