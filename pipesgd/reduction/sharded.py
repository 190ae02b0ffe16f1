"""A reduction carried by rank peers in shards: replicas of k ranks (``dist.ranks_per_replica``)
exchange one flat buffer between them as k shards, rank j of every replica summing shard j over
its peer group (rank j of the other replicas, the slow link) with the reduction it wraps, then
every replica gathers the k summed shards over its own ranks (the fast fabric). The ranks of a
replica hold the same buffer (their weights agree), so the slow link carries each replica's buffer
once in all, not k times, and every rank ends with the whole sum. docs/period-h.md, "Replicas of
k ranks".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..comm import CommStats
from ..comm.base import note
from ..comm.group import all_gather
from ..comm.ring import chunk_bounds
from ..compress import Compressor
from .base import Reduction


class Sharded(Reduction):
    """``inner`` (a per-chunk compressor, carried in the allreduce, or a reduction) on shard
    ``member`` of ``shards`` (:func:`~pipesgd.comm.ring.chunk_bounds` cuts; the flag slot rides in
    the last shard), over the group :meth:`reduce` is given (the peers); then the shards gathered
    over ``gather`` (the replica's ranks, ``shards`` of them). The wrapped reduction's state (an
    error-feedback residual) is this rank's shard's. ``CommStats.wire_bytes`` counts the slow link
    (the peers' exchange); :attr:`gathered_bytes` what this rank has sent inside its replica."""

    def __init__(self, inner: Compressor | Reduction, gather, shards: int, member: int):
        from . import as_reduction  # the package's: it imports every reduction module, this one too

        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or not 0 <= member < shards:
            raise ValueError(f"shards={shards!r}, member={member!r}: must be integers with 0 <= member < shards")
        self.inner = as_reduction(inner)
        self.name = self.inner.name  # type: ignore[misc]  # reported as what it carries
        self.elastic_drop = self.inner.elastic_drop  # type: ignore[misc]
        self.gather, self.shards, self.member = gather, shards, member
        self.gathered_bytes = 0

    @property
    def carries_flag(self) -> bool:
        return self.inner.carries_flag

    def bind(self, shapes: Sequence[torch.Size], allreduce: Callable[..., CommStats], device: torch.device) -> None:
        """The wrapped reduction learns its shard only (a reduction that needs the parameters'
        shapes, PowerSGD, cannot take a cut across them: refused here)."""
        if not self.inner.shardable:
            raise ValueError(f"compressor={self.inner.name} reads each parameter's shape, which a shard of the "
                             "flat buffer cuts across: it is not available with dist.ranks_per_replica > 1")
        numel = sum(s.numel() for s in shapes)
        a, b = chunk_bounds(numel, self.shards)[self.member]
        self.inner.bind([torch.Size([b - a])], allreduce, device)

    def reduce(self, flat: Tensor, group, *, zeroed: bool = False, contributors: int | None = None) -> CommStats:
        bounds = chunk_bounds(flat.numel(), self.shards)
        a, b = bounds[self.member]
        stats = self.inner.reduce(flat[a:b], group, zeroed=zeroed, contributors=contributors)
        if self.shards == 1:
            return stats
        # equal pieces for the backend's all_gather: each shard padded to the longest
        size = bounds[0][1] - bounds[0][0]
        mine = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        mine[:b - a] = flat[a:b]
        out = [torch.empty_like(mine) for _ in range(self.shards)]
        note(f"all_gather of the {self.shards} summed shards inside the replica")
        all_gather(out, mine, self.gather)
        for (lo, hi), piece in zip(bounds, out):
            flat[lo:hi] = piece[:hi - lo]
        self.gathered_bytes += (self.shards - 1) * mine.nbytes
        return stats

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Sharded({self.inner!r}, shard {self.member} of {self.shards})"
