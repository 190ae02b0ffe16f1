"""The α–β–γ cost model of one data-parallel iteration. Pure arithmetic: no torch, no I/O.

Symbols (docs/timing-model.md derives every formula):
α  seconds per message (latency + per-message software cost),
β  seconds per byte on the wire (1 / bandwidth),
γ  seconds per byte of reduction arithmetic (adding a received buffer into a local one),
κ  seconds per UNCOMPRESSED byte for one compress plus one decompress (0 when nothing is compressed),
M  gradient bytes (fp32: 4 per parameter), p workers, r compression ratio (wire bytes = M / r).

All times are seconds unless a name ends in ``_ms``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..modes import MODES as TRAINER_MODES
from .units import parse_bandwidth, parse_latency

ALGORITHMS = ("ring", "tree", "ps")
"""Algorithms :func:`allreduce_time` accepts."""
COMM_ALGORITHMS = ("ring", "tree", "hierarchical", "ps")
"""Everything :func:`comm_time` and :func:`predict_iter_ms` accept."""
MODES = tuple(TRAINER_MODES)
"""``local`` is the trainer's compute-only baseline (no gradient exchange): compute + update."""
COMPRESSORS = ("none", "fp16", "bf16", "int8")
DDP_MODE_COMPRESSORS = TRAINER_MODES["ddp"].compressors
"""DDP ships comm hooks for fp16 and bf16 only; int8 has no DDP row."""

DDP_BUCKET_CAP_BYTES = 25 * 2**20
"""torch DistributedDataParallel's default ``bucket_cap_mb=25``."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket (the LAST layers) is capped at 1 MiB."""

FP32_BYTES = 4
INT8_BLOCK_SIZE = 2048
"""pipesgd.compress.int8's default: one fp32 scale per 2048 values (~3.99x on fp32)."""

MODEL_PARAMS = {
    "resnet20": 269_722,
    "resnet32": 464_154,
    "resnet56": 853_018,
    "resnet18": 11_173_962,
    "mlp": 235_146,
    "cnn": 421_642,
}
"""Trainable parameters of pipesgd.models with 10 classes (counted by building them):
CIFAR ResNet-20/32/56 with option-A (parameter-free) shortcuts, ResNet-18 CIFAR variant (3x3 stem,
option-B projections), the MNIST MLP 784-256-128-10 and the MNIST SmallCNN. ResNet-20 with
option-B (1x1 conv + BN) shortcuts would have 272,474."""


def _check_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_workers(name: str, p: int) -> None:
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {p!r}")


def _check_iterations(iterations: int) -> None:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an integer >= 0, got {iterations!r}")


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"ratio must be a finite number > 0, got {ratio!r}")


def _rounds(p: int) -> int:
    """⌈log2 p⌉ computed exactly on integers."""
    return (p - 1).bit_length()


@dataclass(frozen=True)
class Link:
    """One full-duplex link: α s/message, β s/byte, γ s/byte of reduction on its endpoints."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            _check_nonneg(f"Link.{name}", getattr(self, name))

    @classmethod
    def from_bandwidth(cls, bits_per_second: float, latency_s: float, gamma: float = 0.0) -> Link:
        if isinstance(bits_per_second, bool) or not isinstance(bits_per_second, (int, float)) \
                or not math.isfinite(bits_per_second) or bits_per_second <= 0:
            raise ValueError(f"bits_per_second must be a finite number > 0, got {bits_per_second!r}")
        return cls(alpha=latency_s, beta=8.0 / bits_per_second, gamma=gamma)

    @classmethod
    def parse(cls, bandwidth: str, latency: str, gamma: float = 0.0) -> Link:
        """``Link.parse("100mbit", "50us")``."""
        return cls.from_bandwidth(parse_bandwidth(bandwidth), parse_latency(latency), gamma)

    @property
    def bits_per_second(self) -> float:
        return math.inf if self.beta == 0 else 8.0 / self.beta


# --- collectives ------------------------------------------------------------------------------


def ring_time(nbytes: float, p: int, alpha: float, beta: float, gamma: float = 0.0, ratio: float = 1.0,
              compress_s_per_byte: float = 0.0) -> float:
    """Ring allreduce: reduce-scatter then allgather, 2(p−1) steps of one M/(r·p) chunk each.

    2(p−1)·(α + M/(r·p)·β) + (p−1)/p·M·γ + (1 + (p−1)/(2p))·M·κ. The κ term follows
    pipesgd.comm.ring: each of the p−1 reduce-scatter hops compresses the chunk it sends and
    decompresses the one it receives (p−1 round trips on M/p), the owner encodes and decodes its
    finished chunk (one more), and the allgather decodes the p−1 chunks it receives (half trips).
    """
    if p == 1:
        return 0.0
    t = 2 * (p - 1) * (alpha + nbytes / (ratio * p) * beta) + (p - 1) / p * nbytes * gamma
    if ratio != 1:
        t += (1 + (p - 1) / (2 * p)) * nbytes * compress_s_per_byte
    return t


def tree_time(nbytes: float, p: int, alpha: float, beta: float, gamma: float = 0.0, ratio: float = 1.0,
              compress_s_per_byte: float = 0.0) -> float:
    """Binomial reduce to a root then binomial broadcast (FireCaffe), L = ⌈log2 p⌉ rounds each.

    2L·(α + M/r·β) + L·M·γ + (L+1)·M·κ: every reduce round moves the whole (compressed) gradient one
    hop and the receiver decompresses, adds, and its sender had compressed; the broadcast compresses
    once at the root and decompresses once at each leaf.
    """
    if p == 1:
        return 0.0
    rounds = _rounds(p)
    t = 2 * rounds * (alpha + nbytes / ratio * beta) + rounds * nbytes * gamma
    if ratio != 1:
        t += (rounds + 1) * nbytes * compress_s_per_byte
    return t


def ps_time(nbytes: float, p: int, alpha: float, beta: float, gamma: float = 0.0, ratio: float = 1.0,
            compress_s_per_byte: float = 0.0, *, server_on_worker: bool = False) -> float:
    """One synchronous parameter-server exchange for p workers through ONE server link.

    q·(α + M/r·β) + (p−1)·M·γ + q·(α + M·β) + (q+1)/2·M·κ with q = p remote workers: the q
    compressed pushes are serialized on the server's ingress, the server sums p gradients, the q
    pulls of fp32 weights (never compressed: quantizing weights would change the model) are
    serialized on its egress. Workers compress in parallel (one half round trip on the path), the
    server decompresses q gradients. ``server_on_worker``: the server shares a worker's rank (as
    pipesgd.engine.ps runs it), so q = p−1: that worker's gradient and weights never cross the link.
    """
    if p == 1:
        return 0.0
    remote = p - 1 if server_on_worker else p
    t = remote * (alpha + nbytes / ratio * beta) + (p - 1) * nbytes * gamma + remote * (alpha + nbytes * beta)
    if ratio != 1:
        t += (remote + 1) / 2 * nbytes * compress_s_per_byte
    return t


def hierarchical_time(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link,
                      ratio: float = 1.0, compress_s_per_byte: float = 0.0) -> float:
    """S-Caffe style: binomial reduce inside each node, ring among the node leaders, binomial
    broadcast inside each node. Compression is applied on the inter-node ring only (intra-node
    traffic is fp32: compressing over shared memory or a fast local fabric costs more than it saves).

    2·⌈log2 g⌉·(α_i + M·β_i) + ⌈log2 g⌉·M·γ_i + ring(M, n, α_e, β_e, γ_e, r, κ)
    with g = per_node, n = nodes.
    """
    _check_nonneg("nbytes", nbytes)
    _check_workers("nodes", nodes)
    _check_workers("per_node", per_node)
    _check_ratio(ratio)
    _check_nonneg("compress_s_per_byte", compress_s_per_byte)
    rounds = _rounds(per_node)
    local = 2 * rounds * (intra.alpha + nbytes * intra.beta) + rounds * nbytes * intra.gamma
    return local + ring_time(nbytes, nodes, inter.alpha, inter.beta, inter.gamma, ratio, compress_s_per_byte)


_ALLREDUCE = {"ring": ring_time, "tree": tree_time, "ps": ps_time}


def allreduce_time(algorithm: str, nbytes: float, p: int, alpha: float, beta: float, gamma: float = 0.0,
                   ratio: float = 1.0, *, compress_s_per_byte: float = 0.0,
                   server_on_worker: bool = False) -> float:
    """Seconds to sum an ``nbytes`` fp32 gradient over ``p`` workers with ``algorithm``.

    ``ratio`` is uncompressed/wire bytes; ``compress_s_per_byte`` (κ) is ignored when ratio == 1;
    ``server_on_worker`` applies to ``"ps"`` only (see :func:`ps_time`).
    Raises ValueError for an unknown algorithm, p < 1, a negative or non-finite value, ratio <= 0.
    """
    if algorithm not in _ALLREDUCE:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}"
                         + (" (use hierarchical_time for it)" if algorithm == "hierarchical" else ""))
    _check_workers("p", p)
    for name, value in (("nbytes", nbytes), ("alpha", alpha), ("beta", beta), ("gamma", gamma),
                        ("compress_s_per_byte", compress_s_per_byte)):
        _check_nonneg(name, value)
    _check_ratio(ratio)
    if algorithm == "ps":
        return ps_time(nbytes, p, alpha, beta, gamma, ratio, compress_s_per_byte, server_on_worker=server_on_worker)
    return _ALLREDUCE[algorithm](nbytes, p, alpha, beta, gamma, ratio, compress_s_per_byte)


def comm_time(algorithm: str, nbytes: float, p: int, link: Link, ratio: float = 1.0,
              compress_s_per_byte: float = 0.0, *, per_node: int = 1, intra: Link | None = None,
              server_on_worker: bool = False) -> float:
    """:func:`allreduce_time` on a :class:`Link`, plus ``"hierarchical"`` (p = nodes × per_node;
    ``intra`` defaults to ``link``)."""
    if algorithm != "hierarchical":
        if algorithm not in _ALLREDUCE:
            raise ValueError(f"algorithm must be one of {list(COMM_ALGORITHMS)}, got {algorithm!r}")
        return allreduce_time(algorithm, nbytes, p, link.alpha, link.beta, link.gamma, ratio,
                              compress_s_per_byte=compress_s_per_byte, server_on_worker=server_on_worker)
    _check_workers("p", p)
    _check_workers("per_node", per_node)
    if p % per_node:
        raise ValueError(f"per_node must divide p for hierarchical, got p={p}, per_node={per_node}")
    return hierarchical_time(nbytes, p // per_node, per_node, intra or link, link, ratio, compress_s_per_byte)


# --- compression --------------------------------------------------------------------------------


def int8_scales(numel: int, chunks: int = 1, block_size: int = 0) -> int:
    """fp32 scales int8 puts on the wire for ``numel`` values cut into ``chunks`` nearly equal
    pieces (as pipesgd.comm.ring cuts them), one scale per ``block_size`` values of each piece
    (``0``: one per non-empty piece)."""
    base, extra = divmod(numel, chunks)
    scales = 0
    for i in range(chunks):
        n = base + (1 if i < extra else 0)
        if n:
            scales += 1 if block_size == 0 else -(-n // block_size)
    return scales


def compression_ratio(name: str, numel: int, chunks: int = 1, *, block_size: int = 0) -> float:
    """Uncompressed fp32 bytes / wire bytes for a built-in compressor on ``numel`` values sent as
    ``chunks`` separately compressed pieces (the ring sends p chunks, a tree or a server one).

    none 1; fp16 and bf16 2 (2 bytes per value); int8 4·n / (n + 4·s): 1 byte per value plus s fp32
    scales, s = chunks (one scale per chunk) or, with ``block_size`` > 0, one per block of each
    chunk as pipesgd.compress.int8 does (its default block is :data:`INT8_BLOCK_SIZE`).
    ``numel == 0`` gives 1.0 (nothing is sent either way).
    """
    if name not in COMPRESSORS:
        raise ValueError(f"compressor must be one of {list(COMPRESSORS)}, got {name!r}")
    _check_workers("chunks", chunks)
    for arg, value in (("numel", numel), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{arg} must be an integer >= 0, got {value!r}")
    if numel == 0 or name == "none":
        return 1.0
    if name in ("fp16", "bf16"):
        return 2.0
    return FP32_BYTES * numel / (numel + FP32_BYTES * int8_scales(numel, chunks, block_size))


def chunks_for(algorithm: str, p: int, per_node: int = 1) -> int:
    """How many separately compressed pieces one gradient travels as, for the int8 scale overhead."""
    if algorithm == "ring":
        return p
    if algorithm == "hierarchical":
        return max(p // per_node, 1)
    return 1


# --- iteration time per mode --------------------------------------------------------------------


def _overlapped(work_s: float, comm_s: float, slowdown: float) -> float:
    """Duration of ``work_s`` of compute that starts together with ``comm_s`` of communication and
    runs ``slowdown`` times slower while that communication is in flight (CPU shared with the
    network path). slowdown == 1 means no interference."""
    return work_s + min(comm_s, work_s * slowdown) * (1 - 1 / slowdown)


def _check_mode_args(mode: str, compute_s: float, comm_s: float, update_s: float, width: int,
                     forward_fraction: float, overlap_slowdown: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    for name, value in (("compute_s", compute_s), ("comm_s", comm_s), ("update_s", update_s)):
        _check_nonneg(name, value)
    _check_workers("width", width)
    _check_nonneg("forward_fraction", forward_fraction)
    if forward_fraction > 1:
        raise ValueError(f"forward_fraction must be in [0, 1], got {forward_fraction!r}")
    _check_nonneg("overlap_slowdown", overlap_slowdown)
    if overlap_slowdown < 1:
        raise ValueError(f"overlap_slowdown must be >= 1 (1 = no interference), got {overlap_slowdown!r}")


def iteration_time(mode: str, compute_s: float, comm_s: float, update_s: float = 0.0, width: int = 2,
                   forward_fraction: float = 1 / 3, *, p: int | None = None,
                   overlap_slowdown: float = 1.0) -> float:
    """Steady-state seconds per iteration.

    sync, ps_sync        compute + comm + update
    pipe, width K >= 2   max(compute' + update, comm); width 1 is sync
    ddp                  forward + max(backward', comm) + update   (ideal overlap: a lower bound;
                         :func:`ddp_iteration_time` models the buckets)
    ps_async             max(compute + comm/p + update, comm + p·update)  (needs ``p``)
    local                compute + update (no communication; ``comm_s`` is ignored)

    ``compute'`` is compute stretched by ``overlap_slowdown`` for as long as communication runs
    beside it; ``comm_s`` for the ps modes is :func:`ps_time` (one round of p push/pull pairs
    through the server link). The one-off pipeline fill is in :func:`total_time`, not here.
    """
    _check_mode_args(mode, compute_s, comm_s, update_s, width, forward_fraction, overlap_slowdown)
    if mode == "local":
        return compute_s + update_s
    if mode in ("sync", "ps_sync") or (mode == "pipe" and width == 1):
        return compute_s + comm_s + update_s
    if mode == "pipe":
        return max(_overlapped(compute_s, comm_s, overlap_slowdown) + update_s, comm_s)
    if mode == "ddp":
        forward = forward_fraction * compute_s
        backward = compute_s - forward
        return forward + max(_overlapped(backward, comm_s, overlap_slowdown), comm_s) + update_s
    if p is None:
        raise ValueError("iteration_time('ps_async', ...) needs p, the number of workers")
    _check_workers("p", p)
    return max(compute_s + comm_s / p + update_s, comm_s + p * update_s)


def total_time(mode: str, iterations: int, compute_s: float, comm_s: float, update_s: float = 0.0,
               width: int = 2, forward_fraction: float = 1 / 3, *, p: int | None = None,
               overlap_slowdown: float = 1.0) -> float:
    """Seconds for ``iterations`` steps plus the final flush (every gradient applied once).

    Pipe with K >= 2: the first compute has no reduction beside it and the last reduction no
    compute beside it, so T iterations cost (T−1)·P + (compute + comm + update), P the steady state.
    Exact when communication-bound, at most min(comm, K·update) pessimistic otherwise, and the same
    for every K: more width adds staleness, not speed (:func:`pipeline_schedule` checks it).
    """
    _check_iterations(iterations)
    per_iter = iteration_time(mode, compute_s, comm_s, update_s, width, forward_fraction, p=p,
                              overlap_slowdown=overlap_slowdown)
    if iterations == 0:
        return 0.0
    if mode == "pipe" and width >= 2:
        return (iterations - 1) * per_iter + compute_s + comm_s + update_s
    return iterations * per_iter


def pipeline_schedule(iterations: int, compute_s: float, comm_s: float, update_s: float = 0.0,
                      width: int = 2) -> float:
    """Event-exact completion time of the width-K engine's contract, no CPU interference.

    Step t: compute (needs the weights after step t−1), launch reduction t on the one comm channel
    (it starts when both its gradient and the channel are free), then if t >= K−1 wait for reduction
    t−K+1 and apply it. ``flush()`` waits for and applies the rest in order.
    """
    _check_iterations(iterations)
    _check_workers("width", width)
    step_end = 0.0
    channel_free = 0.0
    done: list[float] = []
    for t in range(iterations):
        grads_ready = step_end + compute_s
        channel_free = max(grads_ready, channel_free) + comm_s
        done.append(channel_free)
        step_end = grads_ready
        if t >= width - 1:
            step_end = max(step_end, done[t - width + 1]) + update_s
    for t in range(max(iterations - width + 1, 0), iterations):
        step_end = max(step_end, done[t]) + update_s
    return step_end


# --- DDP: buckets overlapped with backward --------------------------------------------------------


def ddp_buckets(nbytes: float, bucket_cap_bytes: float = DDP_BUCKET_CAP_BYTES,
                first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES) -> list[float]:
    """Bucket sizes in the order they become ready (first = last layers), DDP's packing by bytes."""
    _check_nonneg("nbytes", nbytes)
    for name, value in (("bucket_cap_bytes", bucket_cap_bytes), ("first_bucket_bytes", first_bucket_bytes)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    sizes: list[float] = []
    left = nbytes
    cap = first_bucket_bytes
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = bucket_cap_bytes
    return sizes or [0.0]


def bucketed_backward(backward_s: float, bucket_bytes: Sequence[float], bucket_comm_s: Sequence[float],
                      overlap_slowdown: float = 1.0) -> tuple[float, float]:
    """(end of backward, end of the last bucket's reduction), both from the start of backward.

    Gradient bytes are assumed to become ready at a uniform rate over backward; bucket i is launched
    when its last byte is ready and the single comm channel is free; backward runs
    ``overlap_slowdown`` times slower while a reduction is in flight.
    """
    if len(bucket_bytes) != len(bucket_comm_s):
        raise ValueError("bucket_bytes and bucket_comm_s must have the same length")
    total = sum(bucket_bytes)
    now = 0.0
    work_done = 0.0
    channel_free = 0.0
    ready = 0.0
    for size, comm in zip(bucket_bytes, bucket_comm_s):
        ready += size
        target = backward_s * (ready / total if total else 1.0)
        if now < channel_free:
            slowed_work = (channel_free - now) / overlap_slowdown
            if work_done + slowed_work >= target:
                now += (target - work_done) * overlap_slowdown
                work_done = target
            else:
                work_done += slowed_work
                now = channel_free
        now += target - work_done
        work_done = target
        channel_free = max(now, channel_free) + comm
    return now, channel_free


def ddp_iteration_time(compute_s: float, bucket_bytes: Sequence[float], bucket_comm_s: Sequence[float],
                       update_s: float = 0.0, forward_fraction: float = 1 / 3,
                       overlap_slowdown: float = 1.0) -> float:
    """forward + (backward with bucket reductions overlapped, until the last one is done) + update."""
    _check_mode_args("ddp", compute_s, sum(bucket_comm_s), update_s, 1, forward_fraction, overlap_slowdown)
    forward = forward_fraction * compute_s
    backward_end, comm_end = bucketed_backward(compute_s - forward, bucket_bytes, bucket_comm_s,
                                               overlap_slowdown)
    return forward + max(backward_end, comm_end) + update_s


# --- one call for training runs, and the table --------------------------------------------------


def _mode_algorithm(mode: str, algorithm: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if algorithm not in COMM_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(COMM_ALGORITHMS)}, got {algorithm!r}")
    if mode.startswith("ps") != (algorithm == "ps"):
        allowed = ["ps"] if mode.startswith("ps") else [a for a in COMM_ALGORITHMS if a != "ps"]
        raise ValueError(f"mode {mode!r} needs algorithm in {allowed}, got {algorithm!r}")


def _predict_s(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
               update_s: float, width: int, ratio: float, kappa: float, *, forward_fraction: float,
               overlap_slowdown: float, bucket_cap_bytes: float | None, first_bucket_bytes: float,
               per_node: int, intra: Link | None, server_on_worker: bool = False) -> tuple[float, float]:
    """(comm seconds, iteration seconds)."""
    _mode_algorithm(mode, algorithm)
    _check_nonneg("compress_s_per_byte", kappa)
    if mode == "local":
        return 0.0, iteration_time(mode, compute_s, 0.0, update_s)
    if mode != "ddp":
        # A server sharing a worker's rank (pipesgd.engine.ps) serves p-1 remote pushes and pulls.
        comm = comm_time(algorithm, nbytes, p, link, ratio, kappa, per_node=per_node, intra=intra,
                         server_on_worker=server_on_worker and algorithm == "ps")
        return comm, iteration_time(mode, compute_s, comm, update_s, width, forward_fraction, p=p,
                                    overlap_slowdown=overlap_slowdown)
    # DDP compresses with a cast hook around the native allreduce: one compress + one decompress
    # per bucket (κ·bytes), the reduction itself runs on the compressed dtype.
    sizes = [nbytes] if bucket_cap_bytes is None else ddp_buckets(nbytes, bucket_cap_bytes, first_bucket_bytes)
    comms = [comm_time(algorithm, b, p, link, ratio, 0.0, per_node=per_node, intra=intra)
             + (b * kappa if ratio != 1 and p > 1 else 0.0) for b in sizes]
    return sum(comms), ddp_iteration_time(compute_s, sizes, comms, update_s, forward_fraction, overlap_slowdown)


def predict_iter_ms(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
                    update_s: float = 0.0, width: int = 2, ratio: float = 1.0,
                    compress_s_per_byte: float = 0.0, *, forward_fraction: float = 1 / 3,
                    overlap_slowdown: float = 1.0, bucket_cap_bytes: float | None = DDP_BUCKET_CAP_BYTES,
                    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES, per_node: int = 1,
                    intra: Link | None = None, server_on_worker: bool = False) -> float:
    """Predicted milliseconds per steady-state iteration: the one call a training run makes to log
    ``predicted_iter_ms`` next to its measured time. ddp uses DDP's bucketing
    (``bucket_cap_bytes=None``: one bucket); ps modes need ``algorithm="ps"``; with
    ``server_on_worker`` the server shares a worker's rank (p workers, p-1 remote push/pull pairs
    through its link: ``ps`` with p-1 in the link terms; iteration formulas keep p)."""
    _, iter_s = _predict_s(mode, algorithm, nbytes, p, link, compute_s, update_s, width, ratio,
                           compress_s_per_byte, forward_fraction=forward_fraction,
                           overlap_slowdown=overlap_slowdown, bucket_cap_bytes=bucket_cap_bytes,
                           first_bucket_bytes=first_bucket_bytes, per_node=per_node, intra=intra,
                           server_on_worker=server_on_worker)
    return iter_s * 1e3


def _plan(width: int, per_node: int, p: int) -> list[tuple[str, str, int]]:
    """(mode, algorithm, width) of every table row; DDP runs the backend's (ring) allreduce."""
    collectives = ["ring", "tree"] + (["hierarchical"] if 1 < per_node < p else [])
    rows = [("sync", a, 1) for a in collectives] + [("pipe", a, width) for a in collectives]
    return rows + [("ddp", "ring", 1), ("ps_sync", "ps", 1), ("ps_async", "ps", 1)]


def predict(numel: int, p: int, link: Link, compute_s: float, update_s: float = 0.0, width: int = 2,
            compressors: Sequence[str] = COMPRESSORS, compress_s_per_byte: Mapping[str, float] | None = None,
            *, forward_fraction: float = 1 / 3, overlap_slowdown: float = 1.0, iterations: int | None = None,
            per_node: int = 1, intra: Link | None = None,
            bucket_cap_bytes: float | None = DDP_BUCKET_CAP_BYTES,
            first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
            int8_block_size: int = INT8_BLOCK_SIZE) -> list[dict]:
    """One row per (mode, algorithm, compressor) for an fp32 model of ``numel`` parameters.

    Row keys: mode, width, algorithm, compressor, ratio, comm_ms, exposed_ms (iteration − compute −
    update), iter_ms, speedup_vs_sync (against sync/ring/none, the blocking fp32 ring) and, when
    ``iterations`` is given, total_s. ddp appears for ring with none/fp16/bf16 (DDP's own hooks).
    """
    for name in compressors:
        compression_ratio(name, 0)
    kappas = dict(compress_s_per_byte or {})
    nbytes = FP32_BYTES * numel
    options = dict(forward_fraction=forward_fraction, overlap_slowdown=overlap_slowdown,
                   bucket_cap_bytes=bucket_cap_bytes, first_bucket_bytes=first_bucket_bytes,
                   per_node=per_node, intra=intra)
    _, baseline = _predict_s("sync", "ring", nbytes, p, link, compute_s, update_s, 1, 1.0, 0.0, **options)
    rows = []
    for mode, algorithm, row_width in _plan(width, per_node, p):
        for name in compressors:
            if mode == "ddp" and name not in DDP_MODE_COMPRESSORS:
                continue
            ratio = compression_ratio(name, numel, chunks_for(algorithm, p, per_node),
                                      block_size=int8_block_size)
            kappa = kappas.get(name, 0.0) if name != "none" else 0.0
            comm, iter_s = _predict_s(mode, algorithm, nbytes, p, link, compute_s, update_s, row_width,
                                      ratio, kappa, **options)
            row = {"mode": mode, "width": row_width, "algorithm": algorithm, "compressor": name,
                   "ratio": ratio, "comm_ms": comm * 1e3,
                   "exposed_ms": max(iter_s - compute_s - update_s, 0.0) * 1e3,
                   "iter_ms": iter_s * 1e3, "speedup_vs_sync": baseline / iter_s if iter_s else math.inf}
            if iterations is not None:
                row["total_s"] = (total_time(mode, iterations, compute_s, comm, update_s, row_width,
                                             forward_fraction, p=p, overlap_slowdown=overlap_slowdown)
                                  if mode != "ddp" else iterations * iter_s)
            rows.append(row)
    return rows
