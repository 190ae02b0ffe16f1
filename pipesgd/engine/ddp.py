"""``trainer.mode=ddp``: PyTorch DistributedDataParallel as the reference, with DDP's own fp16 /
bf16 compression hooks (the compressors ``pipesgd.modes`` lists for this mode)."""

from __future__ import annotations

from torch import nn

from ..compress.none import NoCompression
from .base import ModeArgs
from .direct import DirectEngine


def build(a: ModeArgs) -> tuple[nn.Module, DirectEngine]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    numel = sum(p.numel() for p in a.model.parameters() if p.requires_grad)
    if a.world_size == 1:
        return a.model, DirectEngine(a.optimizer, numel, 4, 1, a.nonfinite)
    ids = [a.device.index] if a.device.type == "cuda" else None
    model = DDP(a.model, device_ids=ids)
    identity = isinstance(a.compressor, NoCompression)
    if not identity:  # fp16 -> fp16_compress_hook, bf16 -> bf16_compress_hook
        model.register_comm_hook(None, getattr(default_hooks, f"{a.compressor.name}_compress_hook"))
    return model, DirectEngine(a.optimizer, numel, 4 if identity else 2, a.world_size, a.nonfinite)
