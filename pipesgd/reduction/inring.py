"""The dense path: the configured allreduce carrying a per-chunk compressor (ring hops or a cast).

Without error feedback this is exactly ``allreduce(flat, compressor, group)``, the path of the
core engine. With ``compressor.error_feedback=true`` the rank first adds its residual, then
encodes its own (corrected) contribution locally, cut into the same p chunks the ring uses, and
keeps ``corrected - decode(encode(corrected))`` as the next residual. That is the error of
encoding this rank's own values; the ring's later hops re-encode partial sums that mix ranks,
and that error belongs to no single rank, so it is not fed back. Chunk r's local encode is
byte for byte what rank r sends on its first ring hop; for elementwise encoders (fp16, bf16)
chunking makes no difference. With ``comm=native`` the encode is the cast the backend's
all_reduce carries (fp16 / bfloat16, round to nearest), so the residual is that cast's error.
Cost: one extra encode + decode of the gradient per step, on the communication thread, and one
gradient-sized residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..comm import CommStats, check_carries, declared
from ..comm.group import group_size
from ..comm.ring import chunk_bounds
from ..compress import Compressor
from .base import Reduction
from .memory import ErrorFeedback


class InRing(Reduction):
    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.name = compressor.name  # type: ignore[misc]  # reported as the compressor it carries
        self.memory = ErrorFeedback() if compressor.error_feedback else None
        self._allreduce: Callable[..., CommStats] | None = None
        self._casts = False
        self._numel = 0

    def bind(self, shapes: Sequence[torch.Size], allreduce: Callable[..., CommStats], device: torch.device) -> None:
        check_carries(allreduce, self.compressor)  # e.g. int8 cannot ride the backend's all_reduce
        self._allreduce = allreduce
        self._casts = bool(declared(allreduce).get("casts"))
        self._numel = sum(s.numel() for s in shapes)

    @property
    def carries_flag(self) -> bool:
        """Stateless: the non-finite flag slot rides in the allreduce's own buffer."""
        return self.memory is None

    def local_decode(self, flat: Tensor, p: int) -> Tensor:
        """What this rank's own values become after one encode + decode, chunk by ring chunk
        (with the backend's all_reduce: the cast it carries)."""
        if self._casts and self.compressor.summable_dtype is not None:  # the native path casts flat / p
            return flat.div(p).to(self.compressor.summable_dtype).to(flat.dtype).mul_(p)
        out = torch.empty_like(flat)
        for a, b in chunk_bounds(flat.numel(), p):
            payload, ctx = self.compressor.compress(flat[a:b])
            out[a:b] = self.compressor.decompress(payload, ctx)
        return out

    def reduce(self, flat: Tensor, group, *, zeroed: bool = False, contributors: int | None = None) -> CommStats:
        if self._allreduce is None:
            raise RuntimeError("InRing.reduce before bind()")
        if self.memory is not None and not zeroed:  # what is fed back is this rank's own error: no divisor
            corrected = self.memory.add_to(flat)
            self.memory.update(corrected, self.local_decode(corrected, group_size(group)))
        return self._allreduce(flat, self.compressor, group)

