"""Where a reduction's device work is queued, and how the caller's stream is ordered against it.

On the CPU every call is a no-op: Gloo blocks the communication thread until bytes have landed,
and the thread's result is the data. On a GPU a returned job proves only that its kernels are
queued (NCCL's ``Work.wait()`` makes the *current stream* wait; the CPU goes on), so the order is
kept by events instead of by blocking:

1. ``ready(buf, ...)`` on the training thread, after the flatten: an event on its stream that the
   communication stream waits on before touching ``buf``; ``record_stream`` tells the caching
   allocator that the tensors made on the training stream are in use on the communication stream.
2. ``run(ready, fn)`` on the communication thread: ``fn``'s kernels (encode, decode, add, the
   NCCL calls' waits) go to one stream per engine on the parameters' device, never the training
   stream, so forward and backward of the next steps overlap them; returns a done-event.
3. ``wait(done)`` on the training thread before the average is read: its stream waits for the
   done-event, the CPU does not (no ``synchronize``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class Streams(Protocol):
    def ready(self, *tensors: Tensor) -> object:
        """On the training thread: a marker after the work queued so far (the flatten); ``tensors``
        will be used by the communication thread's work."""

    def run(self, ready: object, fn: Callable[[], T]) -> tuple[T, object]:
        """On the communication thread: ``fn()`` ordered after ``ready``; its result and a marker
        after all the work it queued."""

    def wait(self, done: object) -> None:
        """On the training thread: what it queues next runs after ``done``."""


class HostStreams:
    """CPU tensors: the data is there when the job returns; nothing to order."""

    def ready(self, *tensors: Tensor) -> None:
        return None

    def run(self, ready: object, fn: Callable[[], T]) -> tuple[T, None]:
        return fn(), None

    def wait(self, done: object) -> None:
        return None


class CudaStreams:
    """One communication stream on ``device`` (created at the first reduction, not at
    construction), ordered against the training thread's current stream by CUDA events."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def ready(self, *tensors: Tensor) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for t in tensors:
            t.record_stream(self.stream)  # freed on the training stream, used on this one too
        return event

    def run(self, ready: torch.cuda.Event, fn: Callable[[], T]) -> tuple[T, torch.cuda.Event]:
        # The stream context also makes this thread's current device the stream's: a thread does
        # not inherit torch.cuda.set_device, and NCCL issues on the current device.
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def wait(self, done: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(done)


def streams_for(device: torch.device) -> Streams:
    """The ordering a reduction of tensors on ``device`` needs."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class OrderedHandle:
    """A handle to ``(value, done)`` from :meth:`Streams.run` whose ``wait()`` returns ``value``
    with the caller's stream ordered after ``done``."""

    def __init__(self, inner, streams: Streams):
        self._inner, self._streams = inner, streams

    def wait(self, timeout: float | None = None):
        value, done = self._inner.wait(timeout)
        self._streams.wait(done)
        return value

    def done(self) -> bool:
        return self._inner.done()
