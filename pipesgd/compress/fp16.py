"""IEEE half precision cast (round to nearest). Values beyond +-65504 overflow to inf, as with
DDP's fp16 compression hook; relative error per value <= 2**-11 in the normal range."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Compressor, Ctx, register


@register("fp16")
class FP16(Compressor):
    identity = False
    summable_dtype = torch.float16
    rel_error = 2.0**-11  # round to nearest, normal range

    def payload_bytes(self, numel: int, elem_size: int = 4) -> int:
        return 2 * numel

    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        return fp16_compress_hook

    def compress(self, t: Tensor) -> tuple[Tensor, Ctx]:
        return t.reshape(-1).to(torch.float16), Ctx.of(t)

    def decompress(self, payload: Tensor, ctx: Ctx) -> Tensor:
        return payload.to(ctx.dtype).view(ctx.shape)

    def payload_like(self, ctx: Ctx) -> Tensor:
        return torch.empty(ctx.numel, dtype=torch.float16, device=ctx.device)
