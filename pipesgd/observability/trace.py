"""Span recording for the overlap timeline (``trainer.trace=true``).

Hot-path code asks :func:`current` for this process's tracer once and wraps work in
``with tracer.span(name, category, step):``. Tracing off (the default), ``current()`` is
:data:`NULL_TRACER`, whose ``span`` returns one shared do-nothing context manager: no clock read,
no allocation, about 0.1 µs per span (docs/observability.md, "Cost"). Tracing on, each
span is one tuple appended to a list (atomic under the GIL, so the training thread and the
communication thread record without a lock).

Spans on one thread are leaves and never nest: the ring records encode / exchange / decode per
hop, not an enclosing "allreduce", so every thread's track is a sequence of disjoint intervals.

:func:`chrome_trace` turns the recorded parts of every rank into Chrome / Perfetto trace-event
JSON: ``pid`` = rank, ``tid`` = thread (0 = the training thread), one ``"X"`` event per span.
Timestamps are wall-clock anchored (``time.time_ns`` at tracer start plus ``perf_counter_ns``
since), so ranks on one host align exactly and ranks on different hosts as well as their clocks
agree; the merged trace starts at 0.

Every span is host time. On a GPU a span around work the host only queues (forward, backward,
the communication thread's kernels) measures the queueing, not the kernels, so the timeline shows
when work was issued, not when the device ran it: for device time read the trainer's CUDA-event
metrics (``time/*_ms``) or a ``torch.profiler`` trace (``make gpu-check`` writes one; docs/gpu.md).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .runinfo import write_json_atomic

CATEGORIES = ("compute", "pack", "wait", "update", "comm", "compress", "eval")
"""Span categories: the trainer's forward/backward (compute) and evaluation (eval); the engine's
flatten (pack), blocking wait for a reduction (wait) and optimizer step (update); the
communication thread's messages (comm) and encode/decode work (compress)."""


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NULL_SPAN = _NullSpan()


class NullTracer:
    """Tracing off: every span is the same no-op object."""

    enabled = False

    def span(self, name: str, cat: str, step: int = -1, hop: int = -1) -> _NullSpan:
        return _NULL_SPAN


NULL_TRACER = NullTracer()


class _Span:
    __slots__ = ("tracer", "name", "cat", "step", "hop", "t0")

    def __init__(self, tracer: Tracer, name: str, cat: str, step: int, hop: int):
        self.tracer, self.name, self.cat, self.step, self.hop = tracer, name, cat, step, hop

    def __enter__(self) -> None:
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc) -> None:
        self.tracer._record(self.name, self.cat, self.t0, time.perf_counter_ns(), self.step, self.hop)


@dataclass
class TracePart:
    """One rank's recording, picklable so ranks can send it to rank 0.

    ``spans``: ``(tid, name, cat, start_ns, end_ns, step, hop)`` with wall-clock-anchored ns;
    ``step``/``hop`` are -1 when not applicable. ``threads``: tid -> thread name.
    """

    rank: int
    threads: dict[int, str] = field(default_factory=dict)
    spans: list[tuple[int, str, str, int, int, int, int]] = field(default_factory=list)


class Tracer:
    """Records spans of every thread of this process.

    ``max_steps``: the first span whose ``step`` is >= this stops the recording on all threads
    (the trace of a long run stays small); None records everything.
    """

    enabled = True

    def __init__(self, rank: int, max_steps: int | None = None):
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                      or max_steps < 1):
            raise ValueError(f"trainer.trace_steps must be an integer >= 1 or null, got {max_steps!r}")
        self.rank = rank
        self.max_steps = max_steps
        self.stopped = False
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self._tids: dict[int, int] = {}
        self._next_tid = 1
        self._part = TracePart(rank)

    def span(self, name: str, cat: str, step: int = -1, hop: int = -1) -> _Span | _NullSpan:
        if self.max_steps is not None and step >= self.max_steps:
            self.stopped = True
        if self.stopped:
            return _NULL_SPAN
        return _Span(self, name, cat, step, hop)

    def _record(self, name: str, cat: str, t0: int, t1: int, step: int, hop: int) -> None:
        if self.stopped:  # a span that was open when recording stopped
            return
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            thread = threading.current_thread()
            if thread is threading.main_thread():
                tid = 0
            else:
                tid, self._next_tid = self._next_tid, self._next_tid + 1
            self._tids[ident] = tid
            self._part.threads[tid] = "main" if tid == 0 else thread.name
        self._part.spans.append((tid, name, cat, t0 + self._offset_ns, t1 + self._offset_ns, step, hop))

    def part(self) -> TracePart:
        return self._part


_current: Tracer | NullTracer = NULL_TRACER


def current() -> Tracer | NullTracer:
    """The tracer of this process (:data:`NULL_TRACER` unless :func:`install` was called)."""
    return _current


def install(tracer: Tracer | NullTracer) -> None:
    """Make ``tracer`` the process's tracer (all threads); ``install(NULL_TRACER)`` turns it off."""
    global _current
    _current = tracer


def chrome_trace(parts: list[TracePart], metadata: dict | None = None) -> dict:
    """Trace-event JSON (the "JSON Object Format" Chrome's about:tracing and Perfetto load).

    One process per rank (``pid`` = rank, named ``rank r``), one thread per recording thread,
    ``ts``/``dur`` in µs from the earliest span of any rank. ``args`` carry ``step`` and ``hop``.
    """
    starts = [s[3] for p in parts for s in p.spans]
    origin = min(starts) if starts else 0
    events: list[dict] = []
    for p in sorted(parts, key=lambda p: p.rank):
        events.append({"ph": "M", "name": "process_name", "pid": p.rank, "tid": 0,
                       "args": {"name": f"rank {p.rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": p.rank, "tid": 0,
                       "args": {"sort_index": p.rank}})
        for tid, name in sorted(p.threads.items()):
            events.append({"ph": "M", "name": "thread_name", "pid": p.rank, "tid": tid, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": p.rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for tid, name, cat, t0, t1, step, hop in p.spans:
            args = {}
            if step >= 0:
                args["step"] = step
            if hop >= 0:
                args["hop"] = hop
            # Integer ns -> µs with 3 decimals: exact, so disjoint spans stay disjoint.
            events.append({"ph": "X", "name": name, "cat": cat, "pid": p.rank, "tid": tid,
                           "ts": (t0 - origin) / 1000, "dur": (t1 - t0) / 1000, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_ns": origin, **(metadata or {})}}


def save(tracer: Tracer, run_dir: str, metadata: dict | None = None) -> None:
    """Collective: every rank sends its part to rank 0, which writes ``run_dir/trace.json``.

    Uses the default process group (call it when no reduction is in flight) and needs no shared
    file system. In a lone process it just writes the file.
    """
    import torch.distributed as dist

    install(NULL_TRACER)
    part = tracer.part()
    if dist.is_available() and dist.is_initialized():
        parts: list[TracePart] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0)
    else:
        parts = [part]
    if parts is not None:
        write_json_atomic(Path(run_dir) / "trace.json", chrome_trace(parts, metadata))
