"""The communication contract: every reduction returns a :class:`Handle` with ``wait()``.

"Launch now, wait later" is the whole pipeline idea: width 1 waits at once, width K waits K-1
steps later. Work is run on one :class:`CommThread` per engine, in submission order, so every rank
issues its point-to-point messages in the same order without any extra coordination.

Algorithms call :func:`note` before each blocking wait ("receiving from rank 1"), so when a peer
stops answering the error (or a watchdog asking :attr:`CommThread.activity`) says whom we waited on.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..registry import Registry

T = TypeVar("T")

REGISTRY: Registry[Callable[..., CommStats]] = Registry("allreduce", facts=("cost",))
"""Allreduces by config name (``comm=ring``): ``fn(tensor, compressor=None, group=None) -> CommStats``
summing ``tensor`` in place. Each declares ``cost``, its α–β phases (:mod:`pipesgd.timing.cost`)."""


def register(name: str, **facts):
    """Decorator: make an allreduce selectable as ``comm=<name>``. ``cost=`` is required; optional:
    ``carries=fn(compressor)`` raising ValueError for a compressor it cannot carry (checked once,
    when a run is configured or an engine binds it), ``casts=True`` when a compressor rides it as a
    cast to its ``summable_dtype`` rather than per-chunk encodes (error feedback then feeds back
    that cast's error), ``node_groups=True`` for a class built with the node groups
    :func:`pipesgd.dist.node_groups` creates, and ``picks=fn(compressor, backend) -> name`` for one
    that runs another registered allreduce, chosen when it is bound (:func:`bind`; comm=auto);
    ``reference=True`` on the one the timing model's baseline runs (:attr:`pipesgd.modes.Mode.reference`)."""
    return REGISTRY.register(name, **facts)


def bind(allreduce: Callable[..., CommStats], compressor, backend: str) -> Callable[..., CommStats]:
    """The allreduce that runs for ``compressor`` (a resolved compressor or reduction) on
    ``backend`` (``"gloo"``, ``"nccl"``, ...): ``allreduce`` itself, or the registered one it picks
    where it declares ``picks`` (comm=auto, docs/gpu.md). Unregistered functions are themselves."""
    picks = declared(allreduce).get("picks")
    return allreduce if picks is None else REGISTRY.get(picks(compressor, backend))


def declared(allreduce: Callable[..., CommStats]) -> Mapping[str, object]:
    """What ``allreduce`` (a registered one, or a caller's own function: nothing) declares."""
    return REGISTRY.facts_of(allreduce)


def check_carries(allreduce: Callable[..., CommStats], compressor) -> None:
    """ValueError if ``allreduce`` (a registered one, by itself or by name) declares it cannot carry
    ``compressor``; an unregistered function is trusted."""
    facts = REGISTRY.facts(allreduce) if isinstance(allreduce, str) else declared(allreduce)
    carries = facts.get("carries")
    if carries is not None:
        carries(compressor)


@dataclass
class CommStats:
    """What one reduction cost this rank.

    ``wire_bytes``: payload bytes this rank sent. ``raw_bytes``: what the same algorithm would have
    sent uncompressed, so ``raw_bytes / wire_bytes`` is the measured compression ratio.
    ``seconds``: wall time of the reduction on the communication thread (hidden or not); on a GPU
    that is only the time to queue it, and ``spans`` holds the device times (:meth:`time_s`).
    """

    wire_bytes: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    spans: tuple = ()  # pipesgd.comm.streams.Span of each reduction, where the device times it

    def __iadd__(self, other: CommStats) -> CommStats:
        self.wire_bytes += other.wire_bytes
        self.raw_bytes += other.raw_bytes
        self.seconds += other.seconds
        self.spans += other.spans
        return self

    def time_s(self) -> float:
        """The reductions' time: the device's where it timed them (reading waits for them, so
        call it lazily), else ``seconds``."""
        return sum(s.seconds() for s in self.spans) if self.spans else self.seconds

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


_ACTIVITY: dict[int, str] = {}
_SOURCE_REF = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # "[.../unbound_buffer.cc:78] "


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, without the C++ source locations backends prepend."""
    return " ".join(_SOURCE_REF.sub("", str(exc)).split())


def note(what: str) -> None:
    """Record what the calling thread is about to block on; one dict store, cheap enough per hop."""
    _ACTIVITY[threading.get_ident()] = what


class CommError(RuntimeError):
    """A reduction failed; the message says what the communication thread was doing at the time
    (e.g. ``ring allreduce reduce-scatter hop 1/1: receiving from rank 1``) and the backend's error."""

    def __init__(self, message: str, activity: str | None = None):
        super().__init__(message)
        self.activity = activity


class Handle(Protocol[T]):
    """``spans``: after ``wait()``, the device times of the work and of the caller's stall
    (:mod:`pipesgd.comm.streams`), ``(None, None)`` where the host clocks are right."""

    spans: tuple[object | None, object | None]

    def wait(self, timeout: float | None = None) -> T:
        """Block until the result is ready and return it (re-raises the worker's exception).
        With ``timeout`` (seconds), raise ``TimeoutError`` if it is not ready by then."""

    def done(self) -> bool: ...


class CompletedHandle(Generic[T]):
    """A handle whose result already exists: single-process runs and restored checkpoints."""

    spans = (None, None)

    def __init__(self, value: T):
        self._value = value

    def wait(self, timeout: float | None = None) -> T:
        return self._value

    def done(self) -> bool:
        return True


class FutureHandle(Generic[T]):
    spans = (None, None)

    def __init__(self, future: Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()


class CommThread:
    """One background thread that runs reductions in FIFO order.

    Gloo and NCCL release the GIL while bytes move, so the caller's forward/backward runs
    concurrently. A failed job poisons the thread: later jobs fail fast with the first error
    instead of hanging on peers that have already given up. A job's exception reaches the waiter
    as a :class:`CommError` naming what the thread was blocked on (see :func:`note`).

    The thread is a daemon: a reduction blocked on a peer that will never answer (the engine has
    already raised its timeout) must not keep the process alive at exit, which a
    ``ThreadPoolExecutor`` worker does (the interpreter joins those at exit).
    """

    def __init__(self, name: str = "pipesgd-comm"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._ident: int | None = None
        self._thread.start()

    @property
    def activity(self) -> str | None:
        """What the thread last said it was blocking on (None before its first job or between jobs)."""
        return None if self._ident is None else _ACTIVITY.get(self._ident)

    def submit(self, fn: Callable[[], T]) -> FutureHandle[T]:
        if self._closed:
            raise RuntimeError("submit() on a closed communication thread (engine.close() was called)")
        future: Future = Future()
        self._jobs.put((future, fn))
        return FutureHandle(future)

    def _serve(self) -> None:
        self._ident = threading.get_ident()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._run(fn))
            except BaseException as e:  # handed to the waiter, never lost
                future.set_exception(e)

    def _run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._error is not None:
                raise CommError(f"an earlier reduction on this rank failed: {self._error}") from self._error
        _ACTIVITY[self._ident] = "running a reduction"
        try:
            result = fn()
        except BaseException as e:
            with self._lock:
                self._error = e
            activity = _ACTIVITY.get(self._ident)
            raise CommError(f"{activity}: {type(e).__name__}: {one_line(e)}", activity) from e
        _ACTIVITY.pop(self._ident, None)
        return result

    def close(self, timeout: float | None = 10.0) -> None:
        """Cancel the jobs not yet started and stop the thread once the running one (if any)
        ends; give up waiting after ``timeout`` seconds (a job blocked on a dead peer never ends,
        and the daemon thread then dies with the process)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)
        if threading.get_ident() != self._ident:
            self._thread.join(timeout)


def timed(fn: Callable[[], CommStats]) -> CommStats:
    """Run ``fn`` and store its wall time in the returned stats."""
    t0 = time.perf_counter()
    stats = fn()
    stats.seconds = time.perf_counter() - t0
    return stats
