"""Progress of a training run on rank 0: a one-line bar on a terminal, log lines otherwise.

``make_progress`` picks the shape once, at construction, so the loop has one code path:

- stderr is a terminal: :class:`ProgressBar` redraws one line (epoch, step, loss, iteration
  time, ETA) at most ten times a second. While it is shown, every log record first erases it
  (a filter on the terminal's logging handlers), so eval lines and warnings never interleave
  with a half-drawn bar; the next update draws it again below them.
- stderr is a file or a pipe (CI, ``nohup``, a SLURM log): :class:`LogProgress` writes one plain
  ``logging`` line every ``log_every`` steps and at the last step.
- any other rank: :class:`NullProgress`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Protocol, TextIO

log = logging.getLogger(__name__)


@dataclass
class Status:
    """What one progress update shows. Times are medians over the recent steps, in ms."""

    epoch: int          # 1-based
    step: int
    total: int
    loss: float
    iter_ms: float
    compute_ms: float
    exposed_comm_ms: float

    @property
    def eta_s(self) -> float:
        return (self.total - self.step) * self.iter_ms / 1e3


class Progress(Protocol):
    def due(self, step: int) -> bool:
        """Whether ``show`` would display anything at ``step`` (so the caller can skip the medians)."""

    def show(self, status: Status) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    def due(self, step: int) -> bool:
        return False

    def show(self, status: Status) -> None:
        pass

    def close(self) -> None:
        pass


class LogProgress:
    """One ``logging`` line every ``log_every`` steps and at the last step."""

    def __init__(self, total: int, log_every: int):
        self.total, self.log_every = total, log_every

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total

    def show(self, status: Status) -> None:
        log.info("epoch %d step %d/%d loss %.4f iter %.1f ms (compute %.1f, exposed comm %.1f) ETA %s",
                 status.epoch, status.step, status.total, status.loss, status.iter_ms, status.compute_ms,
                 status.exposed_comm_ms, format_seconds(status.eta_s))

    def close(self) -> None:
        pass


class _EraseBar(logging.Filter):
    """Erases the bar before its handler writes a record; the filter lets every record pass."""

    def __init__(self, bar: ProgressBar):
        super().__init__()
        self.bar = bar

    def filter(self, record: logging.LogRecord) -> bool:
        self.bar.erase()
        return True


class ProgressBar:
    """A single redrawn line on ``stream`` (a terminal); ``min_interval`` seconds between redraws."""

    def __init__(self, total: int, stream: TextIO, min_interval: float = 0.1):
        self.total, self.stream, self.min_interval = total, stream, min_interval
        self._last = float("-inf")
        self._visible = False
        self._filters: list[tuple[logging.Handler, _EraseBar]] = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is stream:
                f = _EraseBar(self)
                handler.addFilter(f)
                self._filters.append((handler, f))

    def due(self, step: int) -> bool:
        return step == self.total or time.monotonic() - self._last >= self.min_interval

    def show(self, status: Status) -> None:
        self._last = time.monotonic()
        self.stream.write("\r" + self.render(status, shutil.get_terminal_size().columns) + "\x1b[K")
        self.stream.flush()
        self._visible = True

    @staticmethod
    def render(status: Status, columns: int) -> str:
        """The bar line, at most ``columns - 1`` characters (the bar itself shrinks first)."""
        frac = status.step / status.total if status.total else 1.0
        left = f"epoch {status.epoch} "
        right = (f" {status.step}/{status.total} {100 * frac:3.0f}% loss {status.loss:.4f} "
                 f"iter {status.iter_ms:.1f} ms ETA {format_seconds(status.eta_s)}")
        room = columns - 1 - len(left) - len(right) - 2
        if room < 10:
            return (left + right.lstrip())[: max(0, columns - 1)]
        width = min(room, 40)
        filled = int(round(frac * width))
        return f"{left}|{'#' * filled}{'-' * (width - filled)}|{right}"

    def erase(self) -> None:
        if self._visible:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._visible = False

    def close(self) -> None:
        self.erase()
        for handler, f in self._filters:
            handler.removeFilter(f)
        self._filters.clear()


def make_progress(total: int, log_every: int, is_main: bool, stream: TextIO | None = None) -> Progress:
    """A bar on a terminal, log lines otherwise, nothing on ranks other than 0."""
    if not is_main:
        return NullProgress()
    stream = sys.stderr if stream is None else stream
    if _is_terminal(stream):
        return ProgressBar(total, stream)
    return LogProgress(total, log_every)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


def format_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
