"""Identity: the fp32 (or native-dtype) baseline."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Compressor, Ctx, register


@register("none")
class NoCompression(Compressor):
    identity = True
    rel_error = 0.0

    def payload_bytes(self, numel: int, elem_size: int = 4) -> int:
        return numel * elem_size

    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook

    def compress(self, t: Tensor) -> tuple[Tensor, Ctx]:
        return t.reshape(-1), Ctx.of(t)

    def decompress(self, payload: Tensor, ctx: Ctx) -> Tensor:
        return payload.to(ctx.dtype).view(ctx.shape)

    def payload_like(self, ctx: Ctx) -> Tensor:
        return torch.empty(ctx.numel, dtype=ctx.dtype, device=ctx.device)
