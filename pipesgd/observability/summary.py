"""What a finished run reports: the timing model's prediction next to the measured iteration,
TensorBoard's HParams row and summary.json (docs/observability.md). Plain values in, plain dicts out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..timing import TimingModel


@dataclass
class History:
    """Per-step timings (ms) and bytes of this rank, kept for medians in summary.json."""

    iter_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    exposed_comm_ms: list[float] = field(default_factory=list)
    comm_ms: list[float] = field(default_factory=list)
    update_ms: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    wall_time: list[float] = field(default_factory=list)  # time.time() at each step's end
    evals: list[dict] = field(default_factory=list)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def compression_ratio(h: History) -> float:
    """Median measured compression ratio of the steps that applied a reduction."""
    return median([r for r, b in zip(h.ratio, h.wire_bytes) if b]) or 1.0


@dataclass
class Prediction:
    """The timing model's iteration time for a run, from what it has measured so far.

    Compute comes from the calibration file when it was measured for this model size and batch
    ("calibration"), else from the run's own median forward+backward ("measured compute"), which
    under pipe already includes the slowdown from overlapped communication and under ddp includes
    the allreduce that DDP runs inside backward: only the calibrated prediction is a priori.
    """

    timing: TimingModel
    mode: str
    algorithm: str
    width: int
    nbytes: int
    params: int
    batch_size: int
    world_size: int
    compressor: str
    options: dict = field(default_factory=dict)

    def __call__(self, h: History) -> tuple[float | None, str | None]:
        """(predicted ms, where the compute time came from); (None, None) before the first step."""
        if not h.compute_ms:
            return None, None
        calibrated = self.timing.calibrated_compute(self.params, self.batch_size)
        if calibrated is not None:
            compute_s, update_s, source = calibrated.compute_s, calibrated.update_s, "calibration"
        else:
            compute_s, update_s = median(h.compute_ms) / 1e3, (median(h.update_ms) or 0.0) / 1e3
            source = "measured compute"
        return self.timing.iter_ms(self.mode, self.algorithm, self.nbytes, self.world_size, compute_s, update_s,
                                   self.width, compression_ratio(h), self.compressor, **self.options), source


def summary(h: History, result: dict, predicted: tuple[float | None, str | None], **fields) -> dict:
    """summary.json: ``fields`` (mode, width, config, ...) first, then what ``h`` and ``result`` measured."""
    applied_bytes = [b for b in h.wire_bytes if b]
    return {
        **fields,
        "epochs": result["epochs"], "final_train_loss": result["final_train_loss"],
        "averaged_replicas": result["averaged_replicas"],  # whose recent losses (and buffers) the last evaluation averaged
        **{k: v for k, v in result.items() if k.startswith("test_")},  # the objective's metrics
        "median_iter_ms": median(h.iter_ms), "measured_iter_ms": median(h.iter_ms),
        "predicted_iter_ms": predicted[0], "predicted_from": predicted[1],
        "median_compute_ms": median(h.compute_ms),
        "median_update_ms": median(h.update_ms),
        "median_exposed_comm_ms": median(h.exposed_comm_ms),
        "median_comm_ms": median([c for c, b in zip(h.comm_ms, h.wire_bytes) if b]),
        "bytes_per_step": median(applied_bytes) if applied_bytes else 0,
        # over every step, those that sent nothing too (trainer.sync_every > 1 sends once a round)
        "mean_bytes_per_step": sum(h.wire_bytes) / len(h.wire_bytes) if h.wire_bytes else 0,
        # the share of the loop's time spent computing (forward and backward)
        "compute_utilization": sum(h.compute_ms) / sum(h.iter_ms) if sum(h.iter_ms) > 0 else None,
        "compression_ratio": compression_ratio(h),
        "wall_seconds": result["wall_seconds"], "evals": h.evals,
    }
