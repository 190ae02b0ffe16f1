"""WHEN: the one in-flight schedule every engine keeps. Launch now, wait K-1 later, apply.

Standard library only, so the DDP hook and the torch-free timing model import it as the engines do.
An owner (PipeSGD, PipeDiLoCo's fragments through theirs, LiveEngine, the pipelined DDP hook)
launches one unit of work per step, with the tick it was launched at (its own step counter), and
asks :meth:`InFlight.due` when the oldest is to be applied; what *applying* means (the non-finite
policy and the staleness rule; the quorum's vote; DDP's futures; the outer step) stays the owner's::

    schedule.launch(handle, at=step)
    while schedule.due(at=step):          # width K: once K are in flight; delay τ: τ ticks after launch
        at, handle = schedule.pop()
        apply(handle.wait())
    ...
    for at, handle in schedule.drain():   # flush: the rest, oldest first
        apply(handle.wait())

A checkpoint :meth:`settle`\\ s it (each entry waited for, never applied) and a resumed owner
:meth:`restore`\\ s it; an owner collected, or alive at interpreter exit, with work never applied
warns once (the unapplied-work warning), naming itself and the call that applies it.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

W = TypeVar("W")


class InFlight(Generic[W]):
    """Work in flight, oldest first, each entry ``(at, work)``: the tick it was launched at.

    ``width``: how many may be in flight before the oldest is applied (K; 1 applies each at once).
    ``delay``: with ``delay`` = τ > 0 the oldest is due τ ticks after its launch instead (PipeDiLoCo's
    ``sync_delay``, where a tick is an inner step), whatever the width. ``owner`` and ``remedy`` name,
    in the unapplied-work warning, who ended with work in flight and what applies it (``None``: no
    warning; an owner whose in-flight work is dropped by design, such as a quorum's). ``quiesce``,
    called after that warning on each entry's work, lets work that runs Python on a backend's
    threads (a future's callbacks) finish before the interpreter finalizes: a callback still
    waiting for the GIL then is ended by ``pthread_exit`` through C++ frames and the process aborts
    ("terminate called without an active exception") after its work is done."""

    def __init__(self, width: int, delay: int = 0, owner: str | None = None,
                 remedy: str = "call engine.flush() after the last engine.step()",
                 quiesce: Callable[[W], None] | None = None):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1 (1 = synchronous), got {width!r}")
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"delay must be an integer >= 0 (0: when width are in flight), got {delay!r}")
        self.width, self.delay = width, delay
        self._entries: deque[tuple[int, W]] = deque()
        if owner is not None:
            weakref.finalize(self, _warn_unapplied, self._entries, owner, remedy, quiesce)  # at collection or exit

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[tuple[int, W]]:
        return iter(self._entries)

    def oldest(self) -> W | None:
        """The oldest entry's work, left in place (None: nothing in flight)."""
        return self._entries[0][1] if self._entries else None

    def newest(self) -> W | None:
        """The newest entry's work, left in place (None: nothing in flight)."""
        return self._entries[-1][1] if self._entries else None

    @property
    def oldest_at(self) -> int | None:
        """The tick the oldest entry was launched at (None: nothing in flight)."""
        return self._entries[0][0] if self._entries else None

    def launch(self, work: W, at: int) -> None:
        """``work`` is in flight from tick ``at``."""
        self._entries.append((at, work))

    def due(self, at: int, width: int | None = None) -> bool:
        """Whether the oldest entry is to be applied at tick ``at``: ``delay`` ticks after its launch,
        or, without a delay, once ``width`` (default :attr:`width`; PipeSGD's warm-up passes 1) are
        in flight."""
        if not self._entries:
            return False
        if self.delay:
            return at - self._entries[0][0] >= self.delay
        return len(self._entries) >= (self.width if width is None else width)

    def pop(self) -> tuple[int, W]:
        """The oldest entry, removed: ``(at, work)``."""
        return self._entries.popleft()

    def drain(self) -> Iterator[tuple[int, W]]:
        """Every entry, oldest first, each removed as it is handed out (flush)."""
        while self._entries:
            yield self._entries.popleft()

    def settle(self, wait: Callable[[int, W], W]) -> list[W]:
        """For a checkpoint: each entry's work replaced by ``wait(at, work)`` (waited for, never
        applied), in place; returns the settled work, oldest first."""
        settled = [(at, wait(at, work)) for at, work in self._entries]
        self._entries.clear()
        self._entries.extend(settled)
        return [work for _, work in settled]

    def restore(self, entries: Iterable[tuple[int, W]]) -> None:
        """On load: ``entries`` (``(at, work)``, oldest first) are in flight; RuntimeError if work
        already is (a load over work in flight would drop or reorder it)."""
        if self._entries:
            raise RuntimeError(f"load_state_dict with {len(self._entries)} in flight; call flush() first")
        self._entries.extend(entries)

    def clear(self) -> int:
        """Drop every entry unapplied (what a re-formed quorum does to a checkpointed reduction);
        returns how many."""
        n = len(self._entries)
        self._entries.clear()
        return n


def _warn_unapplied(entries: deque, owner: str, remedy: str, quiesce: Callable | None) -> None:
    if entries:
        warnings.warn(f"{owner} ended with {len(entries)} update(s) in flight that were never applied: {remedy}",
                      RuntimeWarning, stacklevel=2)
    if quiesce is None:
        return
    for _, work in entries:
        try:
            quiesce(work)
        except Exception:  # at collection or exit: the warning above is all there is to say
            pass
