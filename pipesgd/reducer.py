"""WHAT is communicated: the gradients of a parameter list, flattened into one fresh buffer.

The buffer is a copy (``torch.cat``), so the next backward writing into ``p.grad`` can never touch a
gradient that is still in flight: that is the double buffering Pipe-SGD needs. The reduction and
the division by the world size run on the communication thread, off the caller's critical path.
The flat gradient is handed to a :class:`~pipesgd.reduction.Reduction`: an in-ring compressor rides
the configured allreduce unchanged; top-k and PowerSGD bring collectives of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import trace
from .comm import CommStats, CommThread, CompletedHandle, Handle
from .compress import Compressor
from .flat import set_grads
from .reduction import Reduction, as_reduction


@dataclass
class Reduced:
    """The averaged gradient of one step, flat, in parameter order, plus what moving it cost."""

    flat: Tensor
    stats: CommStats


class Reducer:
    def __init__(self, params: Iterable[Tensor], compressor: Compressor | Reduction,
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
        self.reduction = as_reduction(compressor)
        self.reduction.bind([p.shape for p in self.params], allreduce)
        self._thread: CommThread | None = None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def flatten(self) -> Tensor:
        """A fresh flat copy of the current gradients (missing ``.grad`` counts as zeros)."""
        return torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params
        ])

    def launch(self, flat: Tensor | None = None) -> Handle[Reduced]:
        """Start averaging ``flat`` (default: the current gradients) across ranks; never blocks."""
        flat = self.flatten() if flat is None else flat
        world = self.world_size
        if world == 1:
            return CompletedHandle(Reduced(flat, CommStats()))
        if self._thread is None:
            self._thread = CommThread()

        def job() -> Reduced:
            stats = self.reduction.reduce(flat, self.group)
            with trace.current().span("average", "comm"):
                flat.div_(world)
            return Reduced(flat, stats)

        return self._thread.submit(job)

    def unflatten(self, flat: Tensor) -> None:
        """Point every ``p.grad`` at its slice of ``flat`` (views, no copy)."""
        set_grads(self.params, flat)

    def state_dict(self) -> dict:
        """The reduction's state (error-feedback residuals, warm starts). Call with nothing in flight."""
        return self.reduction.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reduction.load_state_dict(state)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
