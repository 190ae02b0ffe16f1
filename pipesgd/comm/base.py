"""The communication contract: every reduction returns a :class:`Handle` with ``wait()``.

"Launch now, wait later" is the whole pipeline idea: width 1 waits at once, width K waits K-1
steps later. Work is run on one :class:`CommThread` per engine, in submission order, so every rank
issues its point-to-point messages in the same order without any extra coordination.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


@dataclass
class CommStats:
    """What one reduction cost this rank.

    ``wire_bytes``: payload bytes this rank sent. ``raw_bytes``: what the same algorithm would have
    sent uncompressed, so ``raw_bytes / wire_bytes`` is the measured compression ratio.
    ``seconds``: wall time of the reduction on the communication thread (hidden or not).
    """

    wire_bytes: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0

    def __iadd__(self, other: CommStats) -> CommStats:
        self.wire_bytes += other.wire_bytes
        self.raw_bytes += other.raw_bytes
        self.seconds += other.seconds
        return self

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


class Handle(Protocol[T]):
    def wait(self) -> T:
        """Block until the result is ready and return it (re-raises the worker's exception)."""

    def done(self) -> bool: ...


class CompletedHandle(Generic[T]):
    """A handle whose result already exists: single-process runs and restored checkpoints."""

    def __init__(self, value: T):
        self._value = value

    def wait(self) -> T:
        return self._value

    def done(self) -> bool:
        return True


class FutureHandle(Generic[T]):
    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> T:
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()


class CommThread:
    """One background thread that runs reductions in FIFO order.

    Gloo and NCCL release the GIL while bytes move, so the caller's forward/backward runs
    concurrently. A failed job poisons the thread: later jobs fail fast with the first error
    instead of hanging on peers that have already given up.
    """

    def __init__(self, name: str = "pipesgd-comm"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> FutureHandle[T]:
        def run() -> T:
            with self._lock:
                if self._error is not None:
                    raise RuntimeError("an earlier reduction on this rank failed") from self._error
            try:
                return fn()
            except BaseException as e:
                with self._lock:
                    self._error = e
                raise

        return FutureHandle(self._pool.submit(run))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def timed(fn: Callable[[], CommStats]) -> CommStats:
    """Run ``fn`` and store its wall time in the returned stats."""
    t0 = time.perf_counter()
    stats = fn()
    stats.seconds = time.perf_counter() - t0
    return stats
