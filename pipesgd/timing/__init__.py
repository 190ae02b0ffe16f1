"""Predict iteration time of every training mode from latency, bandwidth, workers and compute.

Pure arithmetic (no torch): ``python -m pipesgd.timing predict ...`` prints the table;
training runs call :func:`predict_iter_ms` (or :class:`TimingModel` from ``conf/timing``) to log
``predicted_iter_ms`` next to the measured time. docs/timing-model.md derives the formulas.
"""

from .calibration import CALIBRATION_KEYS, CalibratedCompute, TimingModel, load_calibration, load_timing_model
from .model import (
    ALGORITHMS,
    COMPRESSORS,
    INT8_BLOCK_SIZE,
    MODEL_PARAMS,
    MODES,
    Link,
    allreduce_time,
    bucketed_backward,
    comm_time,
    compression_ratio,
    ddp_buckets,
    ddp_iteration_time,
    hierarchical_time,
    int8_scales,
    iteration_time,
    pipeline_schedule,
    predict,
    predict_iter_ms,
    ps_time,
    ring_time,
    total_time,
    tree_time,
)
from .units import format_bandwidth, parse_bandwidth, parse_latency

__all__ = [
    "ALGORITHMS", "CALIBRATION_KEYS", "COMPRESSORS", "INT8_BLOCK_SIZE", "MODEL_PARAMS", "MODES",
    "CalibratedCompute", "Link", "TimingModel", "allreduce_time", "bucketed_backward", "comm_time", "compression_ratio", "ddp_buckets",
    "ddp_iteration_time", "format_bandwidth", "hierarchical_time", "int8_scales", "iteration_time",
    "load_calibration", "load_timing_model", "parse_bandwidth", "parse_latency", "pipeline_schedule",
    "predict", "predict_iter_ms", "ps_time", "ring_time", "total_time", "tree_time",
]
