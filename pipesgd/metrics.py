"""Metric writers: TensorBoard on rank 0, a no-op everywhere else, so the loop has one code path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol


class MetricWriter(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Each scalar is logged against the step, with the wall time attached, so TensorBoard's
    STEP / RELATIVE / WALL axes all work and time-to-accuracy curves compare across modes."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, value, global_step=step, walltime=now)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def make_writer(run_dir: str | Path, is_main: bool) -> MetricWriter:
    return TensorBoardWriter(Path(run_dir) / "tb") if is_main else NullWriter()
