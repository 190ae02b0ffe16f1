"""Top-k sparsification with error feedback, reduced by an allgather.

Each rank keeps the k = max(1, round(ratio * n)) largest-magnitude entries of its corrected
gradient (whole flat gradient, not per layer) and sends them as one int32 payload
``[values as fp32 bits | indices]`` of 2k words. Sparse payloads do not sum hop by hop (the
support of a sum is the union of the supports), so every rank gathers every payload and
scatter-adds them in rank order: the same additions in the same order on every rank, hence
identical bits. What was not sent stays in the residual (Stich et al. 2018, "Sparsified SGD with
memory"; Lin et al. 2018, "Deep Gradient Compression" use the same memory).

Wire bytes are those of a ring allgather, (p-1)·8k per rank, against 2(p-1)/p·4n for a dense
ring allreduce: ratio n/(p·k), so the gain shrinks as p grows. Cost: one ``torch.topk`` over the
whole gradient and p scatter-adds per step, on the communication thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..comm import CommStats, ring_bytes
from ..comm.base import timed
from ..comm.group import all_gather, group_size
from .base import Reduction, check_fraction, register
from .memory import ErrorFeedback


@register("topk")
class TopK(Reduction):
    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        self.ratio = check_fraction("compressor.ratio", ratio)
        self.memory = ErrorFeedback() if error_feedback else None
        self.k = 0
        self._numel = 0

    def bind(self, shapes: Sequence[torch.Size], allreduce: Callable[..., CommStats], device: torch.device) -> None:
        self._numel = sum(s.numel() for s in shapes)
        if self._numel >= 2**31:
            raise ValueError(f"topk sends int32 indices; {self._numel} values do not fit")
        self.k = max(1, min(self._numel, round(self.ratio * self._numel)))

    def compress(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(values, int64 indices) of the k largest-magnitude entries of flat ``x``."""
        _, idx = torch.topk(x.abs(), self.k, sorted=False)
        return x[idx], idx

    def decompress(self, values: Tensor, idx: Tensor, numel: int) -> Tensor:
        return torch.zeros(numel, dtype=values.dtype, device=values.device).index_put_((idx,), values)

    def reduce(self, flat: Tensor, group, *, zeroed: bool = False, contributors: int | None = None) -> CommStats:
        return timed(lambda: self._reduce(flat, group, zeroed))

    def _reduce(self, flat: Tensor, group, zeroed: bool) -> CommStats:
        if self.k == 0:
            raise RuntimeError("TopK.reduce before bind()")
        p = group_size(group)
        keeps = self.memory is not None and not zeroed  # a zeroed share sends k zeros, its residual untouched
        corrected = self.memory.add_to(flat) if keeps else flat
        values, idx = self.compress(corrected)
        if keeps:
            self.memory.update(corrected, self.decompress(values, idx, flat.numel()))
        payload = torch.cat([values.to(torch.float32).view(torch.int32), idx.to(torch.int32)])
        gathered = [torch.empty_like(payload) for _ in range(p)]
        all_gather(gathered, payload, group)
        flat.zero_()
        for g in gathered:  # rank order: the same float additions on every rank
            flat.index_add_(0, g[self.k:].long(), g[: self.k].view(torch.float32).to(flat.dtype))
        return CommStats(wire_bytes=(p - 1) * payload.nbytes,
                         raw_bytes=ring_bytes(flat.numel(), p, flat.element_size()))

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, error_feedback={self.memory is not None})"
