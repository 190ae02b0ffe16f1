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
   done-event, the CPU does not (no ``synchronize``); with a deadline the CPU also waits for the
   work, up to the deadline (a hung peer hangs the device, not the communication thread).

Times come the same way. On the CPU a wall-clock interval is the work's time; on a GPU it is only
the time to queue it, so :class:`CudaStreams` and :class:`CudaClock` time with events instead and
hand back a :class:`Span` that is read later (:meth:`Span.seconds` waits for its end event: read
it after the training stream has been synced anyway, never per step).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class Span(Protocol):
    def seconds(self) -> float:
        """The interval's length; for device work, waits for the work to finish."""


@dataclass(frozen=True)
class HostSpan:
    """An interval already measured on the host."""

    value: float

    def seconds(self) -> float:
        return self.value


class EventSpan:
    """The device time between two CUDA events (made with ``enable_timing=True``), read lazily."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def seconds(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Streams(Protocol):
    def ready(self, *tensors: Tensor) -> object:
        """On the training thread: a marker after the work queued so far (the flatten); ``tensors``
        will be used by the communication thread's work."""

    def run(self, ready: object, fn: Callable[[], T]) -> tuple[T, object]:
        """On the communication thread: ``fn()`` ordered after ``ready``; its result and a marker
        after all the work it queued."""

    def begin_wait(self) -> object:
        """On the training thread, as it starts waiting for a result (before any host wait: for
        the communication thread, or for the device): the mark the stall is timed from."""

    def wait(self, done: object, timeout: float | None = None, begun: object = None) -> Span | None:
        """On the training thread: what it queues next runs after ``done``. With ``timeout``, also
        return only once the work before ``done`` has finished, or raise ``TimeoutError`` after
        ``timeout`` seconds (on a GPU a silent peer hangs the device work, not the communication
        thread; the step reads the reduced flag on the host right after, so this waits for nothing
        more). Returns how long the training stream stalls there, from ``begun``
        (:meth:`begin_wait`; default: now), when only the device knows (None: the caller's clock
        does)."""

    def span(self, done: object) -> Span | None:
        """The device time of the work ``run`` queued, from its start to ``done`` (None on the
        host, where the communication thread's own clock is the work's time)."""


class HostStreams:
    """CPU tensors: the data is there when the job returns; nothing to order."""

    def ready(self, *tensors: Tensor) -> None:
        return None

    def run(self, ready: object, fn: Callable[[], T]) -> tuple[T, None]:
        return fn(), None

    def begin_wait(self) -> None:
        return None

    def wait(self, done: object, timeout: float | None = None, begun: object = None) -> None:
        return None  # the job's return was the data's arrival

    def span(self, done: object) -> None:
        return None


def _timing_event(blocking: bool = False):
    return torch.cuda.Event(enable_timing=True, blocking=blocking)


class _DeviceWaiter:
    """One daemon thread that blocks in ``Event.synchronize()`` for the training thread, so that
    thread can wait for device work with a deadline and without polling: it waits on a
    ``threading.Event`` that this thread sets (no sleep, no spin; the done-events are made with
    ``blocking=True``, so the waiter sleeps in the driver instead of spinning a core). The thread
    sets its device once, as the communication thread does. A hung event keeps its thread blocked
    for good (a daemon: the engine has raised by then), so a wait that times out leaves that thread
    and its queue behind and the next wait starts a fresh one: queued behind the hung event, every
    later wait timed out too, whatever its own event did."""

    def __init__(self, device: torch.device):
        self.device = device
        self._jobs: queue.SimpleQueue | None = None  # the serving thread's queue, None: no thread

    def wait(self, event, timeout: float) -> bool:
        """Whether ``event`` completed within ``timeout`` seconds."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), name="pipesgd-device-wait", daemon=True).start()
        landed = threading.Event()
        self._jobs.put((event, landed))
        if landed.wait(timeout):
            return True
        self._jobs = None  # that thread may never return from this event
        return False

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        torch.cuda.set_device(self.device)
        while True:
            event, landed = jobs.get()
            event.synchronize()
            landed.set()


@dataclass(frozen=True)
class CudaDone:
    """What :meth:`CudaStreams.run` queued: from ``start`` (after the ready-event) to ``end``."""

    start: object
    end: object


class _ThreadDevice(threading.local):
    device: bool = False  # this thread has called torch.cuda.set_device


class CudaStreams:
    """One communication stream on ``device`` (created at the first reduction, not at
    construction), ordered against the training thread's current stream by CUDA events."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._bound = _ThreadDevice()  # per thread: has it set its device (run)
        self._waiter = _DeviceWaiter(device)

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

    def run(self, ready: torch.cuda.Event, fn: Callable[[], T]) -> tuple[T, CudaDone]:
        if not self._bound.device:
            # Once per thread, before any other CUDA call: a new thread starts on device 0, and
            # leaving a stream context restores the stream (so the device) the thread had on
            # entering it, which would make device 0 current and create a context there on every
            # rank (hundreds of MB of GPU 0 each; an error on GPUs in exclusive-process mode).
            torch.cuda.set_device(self.device)
            self._bound.device = True
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start = _timing_event()
            start.record(self.stream)  # reached when the data is ready: the span is the reduction's own
            out = fn()
            end = _timing_event(blocking=True)  # finish() may wait on it: without spinning a core
            end.record(self.stream)
        return out, CudaDone(start, end)

    def begin_wait(self):
        # Recorded before the host waits (for the communication thread, then in finish() for the
        # device): the training stream runs dry here while the host blocks, so the stall counts
        # from this point. Recorded after, once the work had ended, the exposed communication read
        # ~0 while the stall was real, with a deadline on NCCL and always on Gloo, whose thread blocks.
        before = _timing_event()
        before.record(torch.cuda.current_stream(self.device))
        return before

    def wait(self, done: CudaDone, timeout: float | None = None, begun=None) -> EventSpan:
        stream = torch.cuda.current_stream(self.device)
        before = self.begin_wait() if begun is None else begun
        after = _timing_event()
        if timeout is not None:
            self.finish(done, timeout)
        stream.wait_event(done.end)
        after.record(stream)
        return EventSpan(before, after)  # the training stream's stall: the exposed communication

    def span(self, done: CudaDone) -> EventSpan:
        return EventSpan(done.start, done.end)

    def finish(self, done: CudaDone, timeout: float) -> None:
        """Return once the work before ``done`` has finished; ``TimeoutError`` after ``timeout``."""
        # One query when the work is done already (hidden communication: the common case), else
        # a blocking wait on another thread with a deadline: never a poll with sleeps, which adds
        # up to a pause's wake-up latency exactly when the communication is exposed, and never
        # synchronize() here, which would block past any deadline. The step reads the reduced flag
        # on the host right after, which waits for this work anyway.
        if done.end.query():
            return
        if not self._waiter.wait(done.end, timeout):
            raise TimeoutError("the communication thread had queued it, but its device work (NCCL) "
                               "did not finish: a peer is silent or the communicator hangs")


def streams_for(device: torch.device) -> Streams:
    """The ordering a reduction of tensors on ``device`` needs."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class OrderedHandle:
    """A handle to ``(value, done)`` from :meth:`Streams.run` whose ``wait()`` returns ``value``
    with the caller's stream ordered after ``done``. After ``wait()``, ``spans`` holds the device
    times of the work and of the caller's stall, (None, None) where the host clocks are right."""

    def __init__(self, inner, streams: Streams):
        self._inner, self._streams = inner, streams
        self.spans: tuple[Span | None, Span | None] = (None, None)

    def wait(self, timeout: float | None = None):
        start = time.monotonic()
        begun = self._streams.begin_wait()
        value, done = self._inner.wait(timeout)
        # the deadline covers the device work too, not only its queueing
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        stall = self._streams.wait(done, left, begun)
        self.spans = (self._streams.span(done), stall)
        return value

    def done(self) -> bool:
        return self._inner.done()


class Clock(Protocol):
    def start(self) -> object:
        """A mark now, in the order of the work queued on this thread's stream."""

    def stop(self, mark: object) -> Span:
        """The interval from ``mark`` to now."""


class HostClock:
    """Wall-clock time: right for work the CPU does itself."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float) -> HostSpan:
        return HostSpan(time.perf_counter() - mark)


class CudaClock:
    """Device time of the work queued on the current stream between ``start`` and ``stop``,
    without a host sync (the trainer's compute time; it used to synchronize the stream each step)."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self):
        mark = _timing_event()
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def stop(self, mark) -> EventSpan:
        return EventSpan(mark, self.start())


def clock_for(device: torch.device) -> Clock:
    """How to time work queued on ``device`` from this thread."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


def device_clock(device: torch.device) -> CudaClock | None:
    """A clock for work only the device knows the time of (its stream's), or None on the host,
    where the caller's wall clock is the work's time."""
    return CudaClock(device) if device.type == "cuda" else None
