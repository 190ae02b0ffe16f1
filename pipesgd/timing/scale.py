"""The scale map: each scheme's predicted step time on a cluster, the winner, and how much the best
pipelined arm gains over the best DDP arm (``python -m pipesgd.timing map``, docs/scale-map.md).

Every arm but one is a :func:`~pipesgd.timing.model.predict_iter_ms` call, the function the
``predict`` table and every training run's ``predicted_iter_ms`` use: one model, not two. The
exception is DDP with torch's ``powerSGD_hook``, whose per-bucket traffic the model has no
compression ratio for: three allreduces per bucket (the uncompressed tensors, then the P factors,
then the Q factors, each waiting for the one before), sized from the layer shapes, priced with
:func:`~pipesgd.timing.model.comm_time`, plus the hook's own compute on the bucket (its matmuls and
QR: the FLOPs the ``powersgd`` reduction declares, ``step_flops``, times the measured
``powersgd_s_per_flop``), and overlapped with backward by
:func:`~pipesgd.timing.model.ddp_iteration_time`, the same bucket schedule the other DDP rows use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .model import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    FP32_BYTES,
    Link,
    chunks_for,
    comm_time,
    compression_ratio,
    ddp_buckets,
    ddp_iteration_time,
    predict_iter_ms,
)
from ..registry import registry
from .presets import BACKWARD_SHARE, Shape

ARMS: dict[str, tuple[str, int, str]] = {
    "sync": ("sync", 1, "none"),
    "ddp": ("ddp", 1, "none"),
    "ddp-fp16": ("ddp", 1, "fp16"),
    "ddp-powersgd": ("ddp", 1, "powersgd"),
    "pipe": ("pipe", 2, "none"),
    "pipe-fp16": ("pipe", 2, "fp16"),
    "pipe-int8": ("pipe", 2, "int8"),
}
"""arm -> (mode, width, compressor): the blocking fp32 ring, DDP with no hook / torch's fp16 hook /
torch's PowerSGD hook, and Pipe-SGD at K = 2 with no, fp16 or int8 compression inside the ring."""

POWERSGD_MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState(min_compression_rate=2)`` default: a tensor is compressed only when
(n + m)·r·2 < n·m; the rest travel uncompressed in the bucket's first allreduce."""


def _positive_int(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Scenario:
    """One cluster and one model: ``params`` fp32 gradient values, ``p`` workers on ``link`` (each
    GPU's inter-node rate), ``compute_s`` of forward + backward per step, ``backward_share`` of it
    backward, ``update_s`` of optimizer step. ``per_node`` > 1 with ``intra`` (the node's fabric)
    also offers the hierarchical allreduce to every arm, which then takes the faster of the two.
    ``shapes`` (the parameter tensors in ``model.parameters()`` order) size PowerSGD's factors;
    without them each DDP bucket is taken as one square matrix (an approximation, stated in
    :attr:`powersgd_bytes_from`)."""

    params: int
    p: int
    link: Link
    compute_s: float
    backward_share: float = BACKWARD_SHARE
    update_s: float = 0.0
    shapes: tuple[Shape, ...] | None = None
    powersgd_rank: int = 2
    per_node: int = 1
    intra: Link | None = None
    overlap_slowdown: float = 1.0
    compress_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    powersgd_s_per_flop: float = 0.0
    """Seconds per FLOP of PowerSGD's compute (``calibrate`` measures it); 0: not modelled."""
    bucket_cap_bytes: float = DDP_BUCKET_CAP_BYTES
    first_bucket_bytes: float | None = None
    """DDP's first bucket (None: torch's default, 1 MiB or the cap if smaller; torch lifts it to the
    cap when ``bucket_cap_mb`` is given, as pipesgd's DDP does for PowerSGD on Gloo)."""

    def __post_init__(self) -> None:
        _positive_int("params", self.params, 1)
        _positive_int("p (workers)", self.p, 2)
        _positive_int("powersgd_rank", self.powersgd_rank, 1)
        _positive_int("per_node", self.per_node, 1)
        if self.p % self.per_node:
            raise ValueError(f"per_node={self.per_node} does not divide p={self.p}")
        if self.intra is not None and not 1 < self.per_node < self.p:
            raise ValueError(f"an intra-node link needs 1 < per_node < p (several nodes of several GPUs), got "
                             f"per_node={self.per_node}, p={self.p}; one node's fabric is the link itself")
        for name, value in (("compute_s", self.compute_s), ("update_s", self.update_s),
                            ("powersgd_s_per_flop", self.powersgd_s_per_flop)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.backward_share, (int, float)) and 0 <= self.backward_share <= 1):
            raise ValueError(f"backward_share must be in [0, 1], got {self.backward_share!r}")
        if self.shapes is not None and sum(math.prod(s) for s in self.shapes) != self.params:
            raise ValueError(f"shapes hold {sum(math.prod(s) for s in self.shapes):,} values, "
                             f"params says {self.params:,}")

    @property
    def nbytes(self) -> int:
        return FP32_BYTES * self.params

    @property
    def algorithms(self) -> tuple[str, ...]:
        return ("ring", "hierarchical") if 1 < self.per_node < self.p else ("ring",)

    @property
    def powersgd_bytes_from(self) -> str:
        return ("per-layer P/Q sizes from the layer shapes" if self.shapes is not None else
                "APPROXIMATION: no layer shapes, each DDP bucket taken as one square matrix")


def _options(s: Scenario, algorithm: str) -> dict:
    first = min(DDP_FIRST_BUCKET_BYTES, s.bucket_cap_bytes) if s.first_bucket_bytes is None else s.first_bucket_bytes
    return dict(forward_fraction=1 - s.backward_share, overlap_slowdown=s.overlap_slowdown,
                bucket_cap_bytes=s.bucket_cap_bytes, first_bucket_bytes=first,
                per_node=s.per_node if algorithm == "hierarchical" else 1,
                intra=s.intra if algorithm == "hierarchical" else None)


def _arm_ms(s: Scenario, mode: str, width: int, compressor: str, algorithm: str) -> tuple[float, float]:
    """(iteration ms, wire compression ratio) of one arm over one algorithm."""
    if compressor == "powersgd":
        return _ddp_powersgd_ms(s, algorithm)
    options = _options(s, algorithm)
    ratio = compression_ratio(compressor, s.params, chunks_for(algorithm, s.p, options["per_node"]))
    kappa = s.compress_s_per_byte.get(compressor, 0.0) if compressor != "none" else 0.0
    return predict_iter_ms(mode, algorithm, s.nbytes, s.p, s.link, s.compute_s, s.update_s, width, ratio, kappa,
                           **options), ratio


def powersgd_bucket_values(shapes: Sequence[Shape] | None, bucket_bytes: Sequence[float],
                           rank: int) -> list[tuple[float, float, float, float]]:
    """(uncompressed, P, Q, FLOPs) of each DDP bucket under torch's ``powerSGD_hook``: the fp32
    values its three allreduces carry, and the floating-point operations of its compute on the
    compressed tensors (the ``powersgd`` reduction's declared ``step_flops``). A tensor viewed as
    n × (numel/n) with r = min(rank, n, m) is sent as P (n·r) and Q (m·r) when (n + m)·r·2 < n·m,
    else whole. DDP fills buckets in reverse parameter order; a tensor straddling a bucket boundary
    (the model's buckets are cut by bytes) is shared in proportion. ``shapes=None``: each bucket is
    one square matrix of its size."""
    flops = registry("reduction").facts("powersgd")["step_flops"]
    out = [[0.0, 0.0, 0.0, 0.0] for _ in bucket_bytes]
    if shapes is None:
        for j, size in enumerate(bucket_bytes):
            side = math.sqrt(size / FP32_BYTES)
            r = min(rank, side)
            out[j][1] = out[j][2] = side * r
            out[j][3] = flops(side, side, r)
        return [tuple(v) for v in out]
    edges = [0.0]
    for size in bucket_bytes:
        edges.append(edges[-1] + size)
    start = 0.0
    j = 0
    for shape in reversed(shapes):
        numel = math.prod(shape)
        n = shape[0] if shape else 1
        m = numel // n if n else 0
        r = min(rank, n, m)
        if (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m:
            parts = (0.0, n * r, m * r, flops(n, m, r))
        else:
            parts = (numel, 0.0, 0.0, 0.0)
        end = start + FP32_BYTES * numel
        while j < len(bucket_bytes) and edges[j + 1] <= start:
            j += 1
        k = j
        while k < len(bucket_bytes) and edges[k] < end:
            share = (min(end, edges[k + 1]) - max(start, edges[k])) / (end - start) if end > start else 1.0
            for i in range(4):
                out[k][i] += share * parts[i]
            k += 1
        start = end
    return [tuple(v) for v in out]


def _ddp_powersgd_ms(s: Scenario, algorithm: str) -> tuple[float, float]:
    options = _options(s, algorithm)
    sizes = ddp_buckets(s.nbytes, s.bucket_cap_bytes, options["first_bucket_bytes"])
    values = powersgd_bucket_values(s.shapes, sizes, s.powersgd_rank)
    # a bucket's three allreduces, one after another, and the hook's compute between them
    comms = [sum(comm_time(algorithm, FP32_BYTES * v, s.p, s.link, per_node=options["per_node"],
                           intra=options["intra"]) for v in bucket[:3]) + bucket[3] * s.powersgd_s_per_flop
             for bucket in values]
    wire = sum(sum(bucket[:3]) for bucket in values)
    iter_s = ddp_iteration_time(s.compute_s, sizes, comms, s.update_s, options["forward_fraction"],
                                s.overlap_slowdown)
    return iter_s * 1e3, s.params / wire if wire else math.inf


def arm_rows(s: Scenario, arms: Sequence[str] = tuple(ARMS)) -> list[dict]:
    """One row per arm: arm, mode, width, compressor, algorithm (the faster one the arm may run),
    ratio (fp32 bytes / wire bytes), iter_ms, speedup_vs_sync (the blocking fp32 ring's step over
    this one's)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"arms must be among {list(ARMS)}, got {unknown}")
    rows = []
    for arm in arms:
        mode, width, compressor = ARMS[arm]
        best = min(((*_arm_ms(s, mode, width, compressor, a), a) for a in s.algorithms), key=lambda t: t[0])
        rows.append({"arm": arm, "mode": mode, "width": width, "compressor": compressor, "algorithm": best[2],
                     "ratio": best[1], "iter_ms": best[0]})
    sync_ms = min(_arm_ms(s, "sync", 1, "none", a)[0] for a in s.algorithms)
    for row in rows:
        row["speedup_vs_sync"] = sync_ms / row["iter_ms"] if row["iter_ms"] else math.inf
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    """winner (fastest arm), best_pipe, best_ddp, and pipe_over_ddp = best DDP step / best pipe step
    (> 1: Pipe-SGD is faster)."""
    def best(prefix: str) -> dict:
        return min((r for r in rows if r["mode"] == prefix), key=lambda r: r["iter_ms"])

    pipe, ddp = best("pipe"), best("ddp")
    return {"winner": min(rows, key=lambda r: r["iter_ms"])["arm"], "best_pipe": pipe["arm"],
            "best_ddp": ddp["arm"], "pipe_over_ddp": ddp["iter_ms"] / pipe["iter_ms"]}


def speedup_grid(params: int, compute_s: float, links: Sequence[Link], workers: Sequence[int], *,
                 backward_share: float = BACKWARD_SHARE, shapes: tuple[Shape, ...] | None = None,
                 **scenario) -> list[list[dict]]:
    """:func:`summarize` for every (link, p): ``grid[i][j]`` is ``links[i]`` at ``workers[j]``."""
    return [[summarize(arm_rows(Scenario(params, p, link, compute_s, backward_share, shapes=shapes, **scenario)))
             for p in workers] for link in links]
