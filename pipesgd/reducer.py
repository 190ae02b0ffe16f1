"""WHAT is communicated: the gradients of a parameter list, flattened into one fresh buffer.

The buffer is a copy (``torch.cat``), so the next backward writing into ``p.grad`` can never touch a
gradient that is still in flight: that is the double buffering Pipe-SGD needs. The reduction and
the division by the world size run on the communication thread, off the caller's critical path.

The buffer carries one extra value after the gradients: a non-finite FLAG, 0 when every local
gradient value is finite and +inf otherwise. It is reduced with the gradient, in the same message,
so every rank learns "some rank had a NaN/inf" from the identical reduced buffer and all decide
alike. 0 and inf (not a count) because every compressor maps 0 to exactly 0 and inf to a
non-finite value, so quantisation can neither invent nor round away the flag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CommStats, CommThread, CompletedHandle, Handle
from .compress import Compressor


@dataclass
class Reduced:
    """The averaged gradient of one step, flat, in parameter order, then the reduced non-finite
    flag; plus what moving it cost and whether this rank's own gradient was non-finite."""

    flat: Tensor
    stats: CommStats
    local_nonfinite: Tensor | bool = False

    @property
    def nonfinite(self) -> bool:
        """Whether any rank's gradient had a NaN/inf: the same answer on every rank. Reads one
        value (a device sync on GPU, at the point the update needs the buffer anyway)."""
        return bool(self.flat[-1].item() != 0)


class Reducer:
    def __init__(self, params: Iterable[Tensor], compressor: Compressor,
                 allreduce: Callable[..., CommStats], group=None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params has no tensor with requires_grad=True: nothing to reduce")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"params must share one dtype, got {sorted(map(str, dtypes))}")
        self.compressor = compressor
        self.allreduce = allreduce
        self.group = group
        self.numel = sum(p.numel() for p in self.params)
        self.flat_numel = self.numel + 1  # gradients + the non-finite flag
        self._thread: CommThread | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def flatten(self) -> Tensor:
        """A fresh flat copy of the current gradients (missing ``.grad`` counts as zeros), then
        one slot for the non-finite flag: ``flat_numel`` values."""
        p0 = self.params[0]
        return torch.cat([
            *((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params),
            p0.new_zeros(1),
        ])

    def launch(self, flat: Tensor | None = None) -> Handle[Reduced]:
        """Start averaging ``flat`` (default: :meth:`flatten`) across ranks after setting its last
        value to this rank's non-finite flag; never blocks.

        The flag test is the sum: NaN and inf propagate through it (inf - inf is NaN), so a finite
        sum means every value is finite. A vectorised sum is ~60x cheaper than
        ``isfinite().all()`` on CPU (0.01 vs 0.7 ms for ResNet-20, measured) and needs no device
        sync. Half-precision gradients are summed in fp32; an fp32 sum overflows only past
        3.4e38, which counts as non-finite too (such an update is no better)."""
        flat = self.flatten() if flat is None else flat
        acc = torch.float32 if flat.element_size() < 4 else flat.dtype
        bad = torch.isfinite(flat[:-1].sum(dtype=acc)).logical_not_()
        flat[-1] = torch.where(bad, float("inf"), 0.0)
        world = self.world_size
        if world == 1:
            return CompletedHandle(Reduced(flat, CommStats(), bad))
        if self._thread is None:
            self._thread = CommThread()

        def job() -> Reduced:
            stats = self.allreduce(flat, self.compressor, self.group)
            flat.div_(world)
            return Reduced(flat, stats, bad)

        return self._thread.submit(job)

    @property
    def activity(self) -> str | None:
        """What the communication thread is blocked on right now, if anything."""
        return None if self._thread is None else self._thread.activity

    def gather(self, value: int) -> list[int]:
        """``value`` of every rank of the group, in rank order. Runs on the communication thread,
        after whatever is already queued there, so call it at the same point on every rank."""
        if self.world_size == 1:
            return [value]
        if self._thread is None:
            self._thread = CommThread()

        def job() -> list[int]:
            device = self.params[0].device
            out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
            dist.all_gather(out, torch.tensor([value], dtype=torch.int64, device=device), group=self.group)
            return [int(t.item()) for t in out]

        return self._thread.submit(job).wait()

    def unflatten(self, flat: Tensor) -> None:
        """Point every ``p.grad`` at its slice of ``flat`` (views, no copy; the flag is ignored)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
