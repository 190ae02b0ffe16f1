"""Predict iteration time of every training mode from latency, bandwidth, workers and compute.

Arithmetic on what the plugins declare (docs/adding-a-plugin.md): ``python -m pipesgd.timing predict ...``
prints the table; :func:`step_time` answers one scheme;
training runs call :func:`predict_iter_ms` (or :class:`TimingModel` from ``conf/timing``) to log
``predicted_iter_ms`` next to the measured time. docs/timing-model.md derives the formulas.
"""

from .calibration import CALIBRATION_KEYS, CalibratedCompute, TimingModel, load_calibration, load_timing_model
from .cost import Phase
from .model import (
    MODEL_PARAMS,
    SERVER,
    Link,
    algorithm_for,
    allreduce_time,
    bucketed_backward,
    chunks_for,
    comm_time,
    compression_ratio,
    ddp_buckets,
    ddp_iteration_time,
    iteration_time,
    phases_time,
    pipeline_schedule,
    predict,
    predict_iter_ms,
    ps_phases,
    step_time,
    total_time,
)
from .units import format_bandwidth, parse_bandwidth, parse_latency

__all__ = [
    "CALIBRATION_KEYS", "MODEL_PARAMS", "SERVER", "CalibratedCompute", "Link", "Phase", "TimingModel",
    "algorithm_for", "allreduce_time", "bucketed_backward", "chunks_for", "comm_time", "compression_ratio",
    "ddp_buckets", "ddp_iteration_time", "format_bandwidth", "iteration_time", "load_calibration",
    "load_timing_model", "parse_bandwidth", "parse_latency", "phases_time", "pipeline_schedule", "predict",
    "predict_iter_ms", "ps_phases", "step_time", "total_time",
]
