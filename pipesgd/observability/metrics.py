"""Metric writers: TensorBoard on rank 0, a no-op everywhere else, so the loop has one code path.

Tags the trainer writes (all against the step; see docs/observability.md for their meaning):
``train/{loss,lr,staleness}``, ``time/{iter,compute,exposed_comm,comm,hidden_comm}_ms``,
``time/{predicted,measured}_iter_ms``, ``comm/{bytes_per_step,compression_ratio}``,
``test/{accuracy,loss}`` (and ``test/bpc`` for a language model). The tags in :data:`BY_TIME` are written a second time as
``by_time/<tag>`` with the step set to the milliseconds since the writer started, so a chart of
``by_time/test/accuracy`` is time-to-accuracy with the same x axis for every run and mode
(TensorBoard's RELATIVE axis starts at each run's first event instead, and WALL at the clock).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

BY_TIME = ("train/loss", "test/accuracy", "test/loss", "test/bpc")

HParam = bool | int | float | str


class MetricWriter(Protocol):
    def scalars(self, values: dict[str, float | None], step: int, walltime: float | None = None) -> None:
        """Log every value that is not None under its tag at ``step``, measured at ``walltime``
        (``time.time()``; default now: the trainer writes a step's values when it reads them)."""

    def hparams(self, hparams: dict[str, HParam], metrics: dict[str, float], step: int) -> None:
        """Record this run's hyper-parameters and final metrics for TensorBoard's HParams tab."""

    def close(self) -> None: ...


class NullWriter:
    def scalars(self, values: dict[str, float | None], step: int, walltime: float | None = None) -> None:
        pass

    def hparams(self, hparams: dict[str, HParam], metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Each scalar is logged against the step with the wall time attached, so TensorBoard's
    STEP / RELATIVE / WALL axes all work; :data:`BY_TIME` tags also against elapsed ms."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._t0 = time.time()

    def scalars(self, values: dict[str, float | None], step: int, walltime: float | None = None) -> None:
        now = time.time() if walltime is None else walltime
        elapsed_ms = int((now - self._t0) * 1e3)
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=step, walltime=now)
                if tag in BY_TIME:
                    self._writer.add_scalar(f"by_time/{tag}", value, global_step=elapsed_ms, walltime=now)

    def hparams(self, hparams: dict[str, HParam], metrics: dict[str, float], step: int) -> None:
        """One HParams session in this run's own directory (not a timestamped sub-run), so the
        session's row links to the run's curves. ``metrics`` tags must not be used by ``scalars``."""
        clean = {k: v for k, v in metrics.items() if v is not None}
        self._writer.add_hparams(hparams, clean, run_name=".", global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def make_writer(run_dir: str | Path, is_main: bool) -> MetricWriter:
    return TensorBoardWriter(Path(run_dir) / "tb") if is_main else NullWriter()
