"""Measured constants for the cost model, and the object training runs use to predict.

``python -m pipesgd_lab.bench.calibrate_cli`` writes a JSON file with exactly these
keys; ``predict --calibration FILE`` and ``conf/timing`` (``calibration: FILE``) read it::

    {"alpha_s": 5e-05, "beta_s_per_byte": 8e-08, "gamma_s_per_byte": 1e-10,
     "compress_s_per_byte": {"fp16": 1e-9, "bf16": 1e-9, "int8": 4e-9},
     "compute_ms": 172.0, "update_ms": 2.0}

Optional keys, read when present: ``overlap_slowdown`` (>= 1: how much slower compute runs while a
reduction is in flight on the same CPU), ``barrier_s`` (what a blocking collective costs a step
beyond its bytes: the ranks' jitter and its latency; :func:`pipesgd.timing.model.barriers_per_step`),
``powersgd_s_per_flop`` (PowerSGD's compute), and ``model_params`` / ``batch_size`` (what ``compute_ms``
was measured for: a training run of that model at that per-worker batch predicts from the
calibrated compute time instead of its own). ``calibrate`` also writes what it measured on the way
(``measurements``, ``workers``, ``model``, ...); readers ignore keys they do not know.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .model import Link, predict_iter_ms
from .presets import ComputePreset
from .rounds import round_iter_ms
from .units import parse_bandwidth, parse_latency

DEFAULT_BANDWIDTH = "10gbit"
DEFAULT_LATENCY = "50us"
"""Used when neither a flag nor a calibration file says otherwise (conf/timing/default.yaml agrees)."""

CALIBRATION_KEYS = ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "compress_s_per_byte",
                    "compute_ms", "update_ms")


def _number(path: Path, key: str, value: object, what: str = "calibration file") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} {path}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def load_calibration(path: str | Path) -> dict:
    """Read and validate a calibration JSON file; returns its dict with numbers as floats.

    Raises FileNotFoundError if ``path`` does not exist and ValueError naming the file and the
    offending key(s) if the JSON is malformed, a key is missing, or a value is not a number >= 0.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"calibration file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"calibration file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path}: expected a JSON object with keys {list(CALIBRATION_KEYS)}")
    missing = [k for k in CALIBRATION_KEYS if k not in data]
    if missing:
        raise ValueError(f"calibration file {path} is missing key(s) {missing}; "
                         f"expected all of {list(CALIBRATION_KEYS)}")
    out = dict(data)
    for key in CALIBRATION_KEYS:
        if key != "compress_s_per_byte":
            out[key] = _number(path, key, data[key])
    kappas = data["compress_s_per_byte"]
    if not isinstance(kappas, dict):
        raise ValueError(f"calibration file {path}: compress_s_per_byte must be an object "
                         f"mapping compressor name to seconds per byte, got {kappas!r}")
    out["compress_s_per_byte"] = {str(k): _number(path, f"compress_s_per_byte.{k}", v) for k, v in kappas.items()}
    for key in ("model_params", "batch_size"):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 1):
            raise ValueError(f"calibration file {path}: {key} must be an integer >= 1, got {data[key]!r}")
    # optional: calibrations from before them price neither PowerSGD's compute nor the barriers
    for key in ("powersgd_s_per_flop", "barrier_s"):
        if key in data:
            out[key] = _number(path, key, data[key])
    if "overlap_slowdown" in data:
        out["overlap_slowdown"] = _number(path, "overlap_slowdown", data["overlap_slowdown"])
        if out["overlap_slowdown"] < 1:
            raise ValueError(f"calibration file {path}: overlap_slowdown must be >= 1, "
                             f"got {data['overlap_slowdown']!r}")
    return out


@dataclass(frozen=True)
class CalibratedCompute:
    """Forward+backward and optimizer step seconds measured for one model at one batch size."""

    compute_s: float
    update_s: float
    model_params: int | None = None
    batch_size: int | None = None


@dataclass(frozen=True)
class TimingModel:
    """A link plus per-compressor costs: what a training run needs to log ``predicted_iter_ms``."""

    link: Link
    compress_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    overlap_slowdown: float = 1.0
    compute: CalibratedCompute | None = None
    barrier_s: float = 0.0

    def calibrated_compute(self, model_params: int, batch_size: int) -> CalibratedCompute | None:
        """The calibrated compute if it was measured for exactly this model size and per-worker
        batch, else None (the caller then falls back to what it measured itself)."""
        c = self.compute
        if c is None or c.model_params != model_params or c.batch_size != batch_size:
            return None
        return c

    def __post_init__(self) -> None:
        if not (isinstance(self.overlap_slowdown, (int, float)) and self.overlap_slowdown >= 1):
            raise ValueError(f"overlap_slowdown must be >= 1 (1 = no interference), got {self.overlap_slowdown!r}")
        if isinstance(self.barrier_s, bool) or not isinstance(self.barrier_s, (int, float)) \
                or not math.isfinite(self.barrier_s) or self.barrier_s < 0:
            raise ValueError(f"barrier_s must be a finite number >= 0, got {self.barrier_s!r}")

    def iter_ms(self, mode: str, algorithm: str, nbytes: float, p: int, compute_s: float,
                update_s: float = 0.0, width: int = 2, ratio: float = 1.0, compressor: str = "none",
                **options) -> float:
        """:func:`predict_iter_ms` with this model's link, κ of ``compressor``, slowdown and barrier.

        ``ratio`` should be the ratio the run measured (wire bytes / raw bytes from its comm stats);
        ``options`` go to :func:`predict_iter_ms` (``per_node``, ``server_on_worker``, ...); with
        ``sync_every`` > 1 (and ``fragments``, ``sync_delay``) to :func:`~pipesgd.timing.rounds.round_iter_ms`.
        """
        kappa = self.compress_s_per_byte.get(compressor, 0.0)  # the model ignores κ when nothing is compressed
        if options.get("sync_every", 1) > 1:  # rounds: one exchange per H steps, maybe in fragments (rounds.py)
            return round_iter_ms(mode, algorithm, nbytes, p, self.link, compute_s, update_s, width, ratio, kappa,
                                 overlap_slowdown=self.overlap_slowdown, **options)
        return predict_iter_ms(mode, algorithm, nbytes, p, self.link, compute_s, update_s, width, ratio, kappa,
                               overlap_slowdown=self.overlap_slowdown, barrier_s=self.barrier_s, **options)


def load_timing_model(bandwidth: str = DEFAULT_BANDWIDTH, latency: str = DEFAULT_LATENCY,
                      gamma_s_per_byte: float = 0.0,
                      calibration: str | Path | None = None, overlap_slowdown: float = 1.0,
                      barrier_s: float = 0.0) -> TimingModel:
    """Build the model from ``conf/timing`` values. A ``calibration`` file, when given, supersedes
    bandwidth, latency and gamma (it was measured; they are assumptions), and its slowdown and
    barrier, when it has them, the configured ones."""
    if calibration is None:
        link = Link.from_bandwidth(parse_bandwidth(bandwidth), parse_latency(latency), gamma_s_per_byte)
        return TimingModel(link, {}, overlap_slowdown, barrier_s=barrier_s)
    cal = load_calibration(calibration)
    link = Link(cal["alpha_s"], cal["beta_s_per_byte"], cal["gamma_s_per_byte"])
    compute = CalibratedCompute(cal["compute_ms"] / 1e3, cal["update_ms"] / 1e3, cal.get("model_params"),
                                cal.get("batch_size"))
    return TimingModel(link, cal["compress_s_per_byte"], cal.get("overlap_slowdown", overlap_slowdown), compute,
                       cal.get("barrier_s", barrier_s))


def load_measured_step(path: str | Path, model: str) -> tuple[ComputePreset, float]:
    """``model``'s row of a ``step_times.json`` that ``make gpu-check`` measured (docs/gpu.md), as
    a compute preset (its step = forward + backward + optimizer at the measured batch) and its
    measured backward share; ValueError naming the file and what is wrong or missing."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a step_times.json from make gpu-check ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or "gpu" not in data:
        raise ValueError(f"{path}: not a step_times.json from make gpu-check (no 'gpu' and 'rows')")
    row = next((r for r in rows if isinstance(r, dict) and r.get("preset") == model), None)
    if row is None:
        have = sorted(str(r.get("preset")) for r in rows if isinstance(r, dict) and r.get("preset"))
        raise ValueError(f"{path}: no measured row for model {model!r} (measured: {have or 'none'})")
    step_ms = _number(path, f"{model}.step_ms", row.get("step_ms"), "measured file")
    share = _number(path, f"{model}.backward_share", row.get("backward_share"), "measured file")
    batch = int(_number(path, f"{model}.batch", row.get("batch"), "measured file"))
    if step_ms <= 0 or not 0 < share < 1 or batch < 1:
        raise ValueError(f"{path}: {model}'s row has step_ms {step_ms}, backward_share {share}, batch {batch}")
    source = (f"measured by make gpu-check on {data['gpu']} (driver {data.get('driver')}, torch "
              f"{data.get('torch')}, {data.get('date')}), {path}")
    return ComputePreset(model, str(data["gpu"]), batch, str(row.get("precision", "?")), 1e3 * batch / step_ms,
                         "samples/s", source), share
