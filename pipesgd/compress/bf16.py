"""16-bit truncation: keep the top 16 bits of each fp32 (sign, 8 exponent bits, 7 mantissa bits).

This is the Pipe-SGD paper's "truncation": no rounding arithmetic, just a shift, so it is the
cheapest lossy encoder there is. It rounds toward zero, so the relative error per value is
below 2**-7 and never changes sign or exponent range (no overflow, unlike fp16). The payload is
those bits as ``torch.bfloat16`` (exactly bfloat16's layout): NCCL has no 16-bit integer type, so
an ``int16`` payload would fail at the first hop on a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Compressor, Ctx, register


@register("bf16")
class BF16Truncation(Compressor):
    # The backend's all_reduce can sum bfloat16 directly; that path casts (round-to-nearest).
    summable_dtype = torch.bfloat16
    identity = False
    rel_error = 2.0**-7  # truncation toward zero

    def payload_bytes(self, numel: int, elem_size: int = 4) -> int:
        return 2 * numel

    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        return bf16_compress_hook

    def compress(self, t: Tensor) -> tuple[Tensor, Ctx]:
        bits = t.reshape(-1).to(torch.float32).view(torch.int32)
        return torch.bitwise_right_shift(bits, 16).to(torch.int16).view(torch.bfloat16), Ctx.of(t)

    def decompress(self, payload: Tensor, ctx: Ctx) -> Tensor:
        bits = torch.bitwise_left_shift(payload.view(torch.int16).to(torch.int32), 16)
        return bits.view(torch.float32).to(ctx.dtype).view(ctx.shape)

    def payload_like(self, ctx: Ctx) -> Tensor:
        return torch.empty(ctx.numel, dtype=torch.bfloat16, device=ctx.device)
