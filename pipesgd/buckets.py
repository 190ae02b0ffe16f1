"""Backward-overlapped gradient buckets (S-Caffe, DDP): a Reducer whose reduction starts while
backward is still running.

Parameters are packed, in reverse registration order (roughly the order backward finishes them),
into buckets of at most ``bucket_bytes``. A post-accumulate-grad hook per parameter counts down
its bucket; when a bucket is complete its gradients are copied into that bucket's slice of the
step's fresh flat buffer (double buffering, as in :class:`~pipesgd.reducer.Reducer`) and the
slice's allreduce is queued on the comm thread at once. ``launch()`` (from ``engine.step()``)
queues whatever backward did not complete (parameters without a gradient count as zeros) and
returns one handle for the whole step. So width 1 hides bucket reductions behind the rest of
backward, and width 2 lets step t's reduction start during t's backward and end during t+1.

Buckets are launched strictly in bucket order (a completed bucket waits for its predecessors),
so every rank queues the same messages in the same order whatever order its hooks fire in.
The averaged result is the unbucketed one: the same values, summed per element by the same
algorithm, only cut at different places. One backward per ``launch()``: a second backward before
the step would accumulate into gradients already sent, and raises. The non-finite flag slot
(:mod:`pipesgd.reducer`) ends the last bucket; each bucket's own test is folded into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import time

import torch
from torch import Tensor

from .comm import CommStats, CommThread, CompletedHandle, Handle
from .compress import Compressor
from .flat import has_nonfinite
from .reducer import Reduced, Reducer


class _StepHandle:
    """All bucket handles of one step: ``wait()`` gives the whole averaged flat gradient."""

    def __init__(self, buf: Tensor, handles: list[Handle[CommStats]], bad: Tensor):
        self._buf, self._handles, self._bad = buf, handles, bad

    def wait(self, timeout: float | None = None) -> Reduced:
        deadline = None if timeout is None else time.monotonic() + timeout
        stats = CommStats()
        for h in self._handles:
            stats += h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return Reduced(self._buf[:-1], stats, self._buf[-1:], self._bad)

    def done(self) -> bool:
        return all(h.done() for h in self._handles)


class BucketReducer(Reducer):
    """:class:`Reducer` with per-bucket launches from backward hooks; same ``launch``/``unflatten``
    contract, but the flat layout is the bucket order (parameters reversed)."""

    def __init__(self, params: Iterable[Tensor], compressor: Compressor,
                 allreduce: Callable[..., CommStats], group=None, bucket_bytes: int = 25 * 2**20):
        super().__init__(params, compressor, allreduce, group)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}")
        self.params = self.params[::-1]
        self.buckets: list[list[int]] = []  # parameter indices (into self.params) per bucket
        size = 0
        for i, p in enumerate(self.params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (size + nbytes > bucket_bytes and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        offsets = [0]
        for p in self.params:
            offsets.append(offsets[-1] + p.numel())
        self._offsets = offsets
        self._bounds = [(offsets[b[0]], offsets[b[-1] + 1]) for b in self.buckets]
        self._bounds[-1] = (self._bounds[-1][0], self._bounds[-1][1] + 1)  # + the flag slot
        bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _, k=bucket_of[i]: self._ready(k))
                       for i, p in enumerate(self.params)]
        self._reset()

    def _reset(self) -> None:
        self._flat: Tensor | None = None
        self._bad = torch.zeros((), dtype=torch.bool, device=self.params[0].device)
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._handles: list[Handle[CommStats]] = []

    def _ready(self, k: int) -> None:
        """Hook: one more parameter of bucket ``k`` has its gradient for this step."""
        self._left[k] -= 1
        if self._left[k] < 0:
            raise RuntimeError("a second backward before engine.step(): bucketed reduction "
                               "(trainer.bucket_mb) supports exactly one backward per step")
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch_bucket(self._next)

    def _launch_bucket(self, k: int) -> None:
        if self._flat is None:
            self._flat = torch.empty(self.flat_numel, dtype=self.params[0].dtype, device=self.params[0].device)
        for i in self.buckets[k]:
            p = self.params[i]
            dst = self._flat[self._offsets[i]:self._offsets[i + 1]]
            dst.copy_(p.grad.reshape(-1)) if p.grad is not None else dst.zero_()
        a, b = self._bounds[k]
        # This bucket's own values (the cheap sum test of mark_nonfinite), before the reduction
        # overwrites them; the last bucket carries the flag for all of them.
        self._bad |= has_nonfinite(self._flat[a:min(b, self.numel)])
        if k == len(self.buckets) - 1:
            self._flat[-1] = torch.where(self._bad, float("inf"), 0.0)
        self._next = k + 1
        world = self.world_size
        if world == 1:
            self._handles.append(CompletedHandle(CommStats()))
            return
        if self._flat.is_cuda:  # the comm thread must see the copy finished
            torch.cuda.current_stream(self._flat.device).synchronize()
        if self._thread is None:
            self._thread = CommThread()
        part = self._flat[slice(*self._bounds[k])]

        def job() -> CommStats:
            stats = self.allreduce(part, self.compressor, self.group)
            part.div_(world)
            return stats

        self._handles.append(self._thread.submit(job))

    def launch(self, flat: Tensor | None = None) -> Handle[Reduced]:
        """Queue the buckets backward did not complete and return the step's handle. An explicit
        ``flat`` (restored state) is reduced whole, as :class:`Reducer` does."""
        if flat is not None:
            return super().launch(flat)
        while self._next < len(self.buckets):
            self._launch_bucket(self._next)
        handle = _StepHandle(self._flat, self._handles, self._bad)
        self._reset()
        return handle

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        super().close()
