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
    flag; plus what moving it cost and how many non-finite values this rank contributed."""

    flat: Tensor
    stats: CommStats
    local_nonfinite: Tensor | int = 0

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

    def flatten(self) -> tuple[Tensor, Tensor]:
        """A fresh flat copy of the current gradients (missing ``.grad`` counts as zeros) with the
        non-finite flag appended, and the count of non-finite values (a 0-d tensor, no sync).
        The count costs one pass over the gradient, small next to packing it."""
        p0 = self.params[0]
        flat = torch.cat([
            *((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params),
            p0.new_zeros(1),
        ])
        count = torch.isfinite(flat[:-1]).logical_not_().sum()
        flat[-1] = torch.where(count > 0, float("inf"), 0.0)
        return flat, count

    def launch(self) -> Handle[Reduced]:
        """Start averaging the current gradients (and the flag) across ranks; never blocks."""
        flat, count = self.flatten()
        world = self.world_size
        if world == 1:
            return CompletedHandle(Reduced(flat, CommStats(), count))
        if self._thread is None:
            self._thread = CommThread()

        def job() -> Reduced:
            stats = self.allreduce(flat, self.compressor, self.group)
            flat.div_(world)
            return Reduced(flat, stats, count)

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
