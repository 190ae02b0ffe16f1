"""The α–β–γ cost model of one data-parallel iteration: arithmetic on what the plugins declare
(a mode's overlap and server, an allreduce's phases, a compressor's payload size), read through
:mod:`pipesgd.registry`; no I/O. The arithmetic itself needs no torch; looking up an allreduce or
a compressor imports its package (torch).

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

from ..modes import carries, get_mode, modes, modes_with
from ..registry import registry
from .cost import Phase
from .units import parse_bandwidth, parse_latency

SERVER = "ps"
"""The exchange of the modes that declare ``server=True``: pushes to and pulls from one
parameter server (:func:`ps_phases`). Every other algorithm is a registered allreduce, priced by
the ``cost`` it declares (``pipesgd/comm/``)."""

DDP_BUCKET_CAP_BYTES = 25 * 2**20
"""torch DistributedDataParallel's default ``bucket_cap_mb=25``."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket (the LAST layers) is capped at 1 MiB."""

FP32_BYTES = 4

MODEL_PARAMS = {"resnet20": 269_722, "resnet32": 464_154, "resnet56": 853_018, "resnet18": 11_173_962,
                "mlp": 235_146, "cnn": 421_642, "gpt": 1_239_040}
"""Trainable parameters of pipesgd.models with 10 classes (counted by building them): CIFAR
ResNet-20/32/56 with option-A (parameter-free) shortcuts, ResNet-18 CIFAR variant (3x3 stem,
option-B projections), the MNIST MLP 784-256-128-10 and the MNIST SmallCNN; the GPT of
+experiment=gpt_shakespeare (vocabulary 256, 128 positions, conf/model/gpt.yaml). ResNet-20 with
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


def ps_phases(nbytes: float, p: int, ratio: float = 1.0, *, server_on_worker: bool = False) -> tuple[Phase, ...]:
    """One synchronous parameter-server exchange for p workers through ONE server link.

    q·(α + M/r·β) + (p−1)·M·γ + q·(α + M·β) + (q+1)/2·M·κ with q = p remote workers: the q
    compressed pushes are serialized on the server's ingress, the server sums p gradients, the q
    pulls of fp32 weights (never compressed: quantizing weights would change the model) are
    serialized on its egress. Workers compress in parallel (one half round trip on the path), the
    server decompresses q gradients. ``server_on_worker``: the server shares a worker's rank (as
    pipesgd.engine.ps runs it), so q = p−1: that worker's gradient and weights never cross the link.
    """
    if p == 1:
        return ()
    remote = p - 1 if server_on_worker else p
    return (Phase(remote, nbytes / ratio, (p - 1) * nbytes, (remote + 1) / 2 * nbytes), Phase(remote, nbytes))


def _cost(algorithm: str):
    """``fn(nbytes, p, ratio, per_node)``: the phases ``algorithm`` declares (a registered
    allreduce's ``cost``, or the server's); ValueError naming the known algorithms."""
    if algorithm == SERVER:
        return None
    allreduces = registry("allreduce")
    if algorithm not in allreduces:
        raise ValueError(f"algorithm must be one of {[*allreduces, SERVER]}, got {algorithm!r}")
    return allreduces.facts(algorithm)["cost"]


def phases_time(phases: Sequence[Phase], link: Link, intra: Link | None = None, ratio: float = 1.0,
                compress_s_per_byte: float = 0.0) -> float:
    """Seconds of ``phases`` on ``link`` (``intra`` for the node-local ones, default ``link``);
    κ counts only when the payload is compressed (``ratio != 1``)."""
    t = 0.0
    for ph in phases:
        on = intra if ph.link == "intra" and intra is not None else link
        t += ph.steps * (on.alpha + ph.step_bytes * on.beta) + ph.reduce_bytes * on.gamma
        if ratio != 1:
            t += ph.codec_bytes * compress_s_per_byte
    return t


def comm_time(algorithm: str, nbytes: float, p: int, link: Link, ratio: float = 1.0,
              compress_s_per_byte: float = 0.0, *, per_node: int = 1, intra: Link | None = None,
              server_on_worker: bool = False) -> float:
    """Seconds to sum an ``nbytes`` fp32 gradient over ``p`` workers with ``algorithm`` (a
    registered allreduce, or ``"ps"``) on ``link``: the algorithm's declared phases, priced.

    ``ratio`` is uncompressed/wire bytes; ``compress_s_per_byte`` (κ) is ignored when ratio == 1;
    ``per_node`` ranks per node group (hierarchical; ``intra`` is their link, default ``link``);
    ``server_on_worker`` applies to ``"ps"`` only (see :func:`ps_phases`).
    Raises ValueError for an unknown algorithm, p < 1, a negative or non-finite value, ratio <= 0.
    """
    cost = _cost(algorithm)
    _check_workers("p", p)
    _check_workers("per_node", per_node)
    for name, value in (("nbytes", nbytes), ("compress_s_per_byte", compress_s_per_byte)):
        _check_nonneg(name, value)
    _check_ratio(ratio)
    phases = (ps_phases(nbytes, p, ratio, server_on_worker=server_on_worker) if cost is None
              else cost(nbytes, p, ratio, per_node))
    return phases_time(phases, link, intra, ratio, compress_s_per_byte)


def allreduce_time(algorithm: str, nbytes: float, p: int, alpha: float, beta: float, gamma: float = 0.0,
                   ratio: float = 1.0, *, compress_s_per_byte: float = 0.0,
                   server_on_worker: bool = False, per_node: int = 1) -> float:
    """:func:`comm_time` on a link given as α, β, γ."""
    return comm_time(algorithm, nbytes, p, Link(alpha, beta, gamma), ratio, compress_s_per_byte,
                     per_node=per_node, server_on_worker=server_on_worker)


# --- compression --------------------------------------------------------------------------------


def _compressor(compressor):
    """A compressor instance: ``compressor`` itself, or the one registered under that name with
    its defaults."""
    return registry("compressor").get(compressor)() if isinstance(compressor, str) else compressor


def compression_ratio(compressor, numel: int, chunks: int = 1) -> float:
    """Uncompressed fp32 bytes / wire bytes for a compressor (a registered name, built with its
    defaults, or an instance) on ``numel`` values sent as ``chunks`` separately compressed pieces
    (the ring sends p chunks, a tree or a server one, cut as pipesgd.comm.ring cuts them): the
    payload sizes the compressor declares (``payload_bytes``, block scales included).
    ``numel == 0`` gives 1.0 (nothing is sent either way).
    """
    comp = _compressor(compressor)
    _check_workers("chunks", chunks)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    if numel == 0 or comp.identity:
        return 1.0
    base, extra = divmod(numel, chunks)
    wire = sum(comp.payload_bytes(base + (1 if i < extra else 0), FP32_BYTES) for i in range(chunks)
               if base + (1 if i < extra else 0))
    return FP32_BYTES * numel / wire


def chunks_for(algorithm: str, p: int, per_node: int = 1) -> int:
    """How many separately compressed pieces one gradient travels as (the phases' declared
    ``chunks``: p over a flat ring, one per node leader in a hierarchy, else one)."""
    phases = () if algorithm == SERVER else _cost(algorithm)(FP32_BYTES, p, 1.0, per_node)
    return max((ph.chunks for ph in phases), default=1)


# --- iteration time per mode --------------------------------------------------------------------


def _overlapped(work_s: float, comm_s: float, slowdown: float) -> float:
    """Duration of ``work_s`` of compute that starts together with ``comm_s`` of communication and
    runs ``slowdown`` times slower while that communication is in flight (CPU shared with the
    network path). slowdown == 1 means no interference."""
    return work_s + min(comm_s, work_s * slowdown) * (1 - 1 / slowdown)


def pipelined_time(compute_s: float, comm_s: float, update_s: float = 0.0, overlap_slowdown: float = 1.0) -> float:
    """Steady-state seconds of a step whose reduction is waited for a step later (width >= 2):
    max(compute' + update, comm), compute' stretched by ``overlap_slowdown`` while comm runs beside it.
    Pipe-SGD's engine at K >= 2 and DDP with the pipelined hook (its buckets' reductions in flight
    across the step boundary) are both this."""
    return max(_overlapped(compute_s, comm_s, overlap_slowdown) + update_s, comm_s)


def _check_step_args(compute_s: float, comm_s: float, update_s: float, width: int, forward_fraction: float,
                     overlap_slowdown: float) -> None:
    for name, value in (("compute_s", compute_s), ("comm_s", comm_s), ("update_s", update_s)):
        _check_nonneg(name, value)
    _check_workers("width", width)
    _check_nonneg("forward_fraction", forward_fraction)
    if forward_fraction > 1:
        raise ValueError(f"forward_fraction must be in [0, 1], got {forward_fraction!r}")
    _check_nonneg("overlap_slowdown", overlap_slowdown)
    if overlap_slowdown < 1:
        raise ValueError(f"overlap_slowdown must be >= 1 (1 = no interference), got {overlap_slowdown!r}")


def _known(mode: str) -> None:
    """Every registered ``trainer.mode`` is priced (``local``, the compute-only baseline, as compute
    + update)."""
    if mode not in modes():
        raise ValueError(f"mode must be one of {modes()}, got {mode!r}")


def _width(mode: str, width: int) -> int:
    """The width ``mode`` runs at: its own fixed width, else ``width``."""
    return get_mode(mode).width or width


def iteration_time(mode: str, compute_s: float, comm_s: float, update_s: float = 0.0, width: int = 2,
                   forward_fraction: float = 1 / 3, *, p: int | None = None,
                   overlap_slowdown: float = 1.0) -> float:
    """Steady-state seconds per iteration, by what the mode declares a reduction overlaps with.

    pipeline, width 1    compute + comm + update                   (sync, ps_sync, pipe at K = 1)
    pipeline, K >= 2     max(compute' + update, comm)              (pipe)
    backward             forward + max(backward', comm) + update   (ddp; ideal overlap: a lower
                         bound, :func:`ddp_iteration_time` models the buckets)
    async                max(compute + comm/p + update, comm + p·update)  (ps_async; needs ``p``)
    none                 compute + update (no communication; ``comm_s`` is ignored)   (local)

    ``compute'`` is compute stretched by ``overlap_slowdown`` for as long as communication runs
    beside it; ``comm_s`` for the server modes is one round of p push/pull pairs through the
    server link (:func:`ps_phases`). The one-off pipeline fill is in :func:`total_time`, not here.
    """
    _known(mode)
    _check_step_args(compute_s, comm_s, update_s, width, forward_fraction, overlap_slowdown)
    overlap = get_mode(mode).overlap
    if overlap == "none":
        return compute_s + update_s
    if overlap == "pipeline":
        if _width(mode, width) == 1:
            return compute_s + comm_s + update_s
        return pipelined_time(compute_s, comm_s, update_s, overlap_slowdown)
    if overlap == "backward":
        forward = forward_fraction * compute_s
        backward = compute_s - forward
        return forward + max(_overlapped(backward, comm_s, overlap_slowdown), comm_s) + update_s
    if p is None:
        raise ValueError(f"iteration_time({mode!r}, ...) needs p, the number of workers")
    _check_workers("p", p)
    return max(compute_s + comm_s / p + update_s, comm_s + p * update_s)


def total_time(mode: str, iterations: int, compute_s: float, comm_s: float, update_s: float = 0.0,
               width: int = 2, forward_fraction: float = 1 / 3, *, p: int | None = None,
               overlap_slowdown: float = 1.0) -> float:
    """Seconds for ``iterations`` steps plus the final flush (every gradient applied once).

    A pipeline with K >= 2: the first compute has no reduction beside it and the last reduction no
    compute beside it, so T iterations cost (T−1)·P + (compute + comm + update), P the steady state.
    Exact when communication-bound, at most min(comm, K·update) pessimistic otherwise, and the same
    for every K: more width adds staleness, not speed (:func:`pipeline_schedule` checks it).
    """
    _check_iterations(iterations)
    per_iter = iteration_time(mode, compute_s, comm_s, update_s, width, forward_fraction, p=p,
                              overlap_slowdown=overlap_slowdown)
    if iterations == 0:
        return 0.0
    if get_mode(mode).overlap == "pipeline" and _width(mode, width) >= 2:
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
    _check_step_args(compute_s, sum(bucket_comm_s), update_s, 1, forward_fraction, overlap_slowdown)
    forward = forward_fraction * compute_s
    backward_end, comm_end = bucketed_backward(compute_s - forward, bucket_bytes, bucket_comm_s,
                                               overlap_slowdown)
    return forward + max(backward_end, comm_end) + update_s


# --- one call for training runs, and the table --------------------------------------------------


def algorithm_for(mode: str, comm: str) -> str:
    """What carries ``mode``'s gradients when the config's allreduce is ``comm``: that allreduce
    when the mode runs the configured one, the server's exchange (``"ps"``) when it has a server,
    else the allreduce it always runs (its declared ``fixed_comm``)."""
    row = get_mode(mode)
    if row.allreduce:
        return comm
    return SERVER if row.server else row.fixed_comm or comm


def _mode_algorithm(mode: str, algorithm: str) -> None:
    _known(mode)
    _cost(algorithm)
    if get_mode(mode).server != (algorithm == SERVER):
        allowed = [SERVER] if get_mode(mode).server else list(registry("allreduce"))
        raise ValueError(f"mode {mode!r} needs algorithm in {allowed}, got {algorithm!r}")


def barriers_per_step(mode: str, width: int, buffers: bool = False) -> int:
    """Blocking collectives a step of ``mode`` waits at with compute since the one before: at each,
    every rank waits for the slowest to arrive, so the ranks' step-to-step jitter (and the
    collective's latency) is paid there, whatever its bytes (``barrier_s``, which ``calibrate``
    measures as a step followed by an allreduce of one value, minus the step).

    ``buffers``: the model has buffers (BatchNorm statistics) the mode broadcasts every step.
    DDP broadcasts them before each forward (``broadcast_buffers``) and, at width 1, waits for its
    gradient's buckets after backward: two barriers a step with buffers. A width-1 pipeline blocks
    on its reduction (the buffers' broadcast rides the same sequence, with no compute between):
    one. A pipeline of width >= 2 waits for a reduction its peers launched a step earlier (their
    lag is absorbed) but for the buffers' broadcast of this step (pipe's ``step()``): one with
    buffers, else none. ``local`` and the asynchronous server wait for nobody."""
    row = get_mode(mode)
    if row.overlap in ("none", "async"):
        return 0
    width = row.runs_at(width)
    if row.overlap == "backward":
        return int(buffers) + (width == 1)
    return 1 if width == 1 else int(buffers)


def barrier_time(barrier_s: float, mode: str, width: int, buffers: bool, p: int) -> float:
    """Seconds a step of ``mode`` spends at its :func:`barriers_per_step`, ``barrier_s`` each; none
    with one worker (nobody to wait for). The one place every prediction (a run's, the map's, a
    total) prices barriers."""
    _check_nonneg("barrier_s", barrier_s)
    return barrier_s * barriers_per_step(mode, width, buffers) if p > 1 else 0.0


def _predict_s(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
               update_s: float, width: int, ratio: float, kappa: float, *, barrier_s: float = 0.0,
               buffers: bool = False, **options) -> tuple[float, float]:
    """(comm seconds, iteration seconds): the step's compute and communication, plus ``barrier_s``
    at each of its :func:`barriers_per_step`."""
    comm, iter_s = _comm_and_step_s(mode, algorithm, nbytes, p, link, compute_s, update_s, width, ratio, kappa,
                                    **options)
    return comm, iter_s + barrier_time(barrier_s, mode, width, buffers, p)


def _comm_and_step_s(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
                     update_s: float, width: int, ratio: float, kappa: float, *, forward_fraction: float,
                     overlap_slowdown: float, bucket_cap_bytes: float | None, first_bucket_bytes: float,
                     per_node: int, intra: Link | None, server_on_worker: bool = False) -> tuple[float, float]:
    """(comm seconds, iteration seconds) without barriers."""
    _mode_algorithm(mode, algorithm)
    _check_nonneg("compress_s_per_byte", kappa)
    overlap = get_mode(mode).overlap
    if overlap == "none":
        return 0.0, iteration_time(mode, compute_s, 0.0, update_s)
    if overlap != "backward":
        # A server sharing a worker's rank (pipesgd.engine.ps) serves p-1 remote pushes and pulls.
        comm = comm_time(algorithm, nbytes, p, link, ratio, kappa, per_node=per_node, intra=intra,
                         server_on_worker=server_on_worker)
        return comm, iteration_time(mode, compute_s, comm, update_s, width, forward_fraction, p=p,
                                    overlap_slowdown=overlap_slowdown)
    sizes = [nbytes] if bucket_cap_bytes is None else ddp_buckets(nbytes, bucket_cap_bytes, first_bucket_bytes)
    comms = ddp_bucket_comms(algorithm, sizes, p, link, ratio, kappa, per_node=per_node, intra=intra)
    if get_mode(mode).runs_at(width) >= 2:  # the pipelined hook: a bucket's average is applied a step later
        return sum(comms), pipelined_time(compute_s, sum(comms), update_s, overlap_slowdown)
    return sum(comms), ddp_iteration_time(compute_s, sizes, comms, update_s, forward_fraction, overlap_slowdown)


def ddp_bucket_comms(algorithm: str, bucket_bytes: Sequence[float], p: int, link: Link, ratio: float = 1.0,
                     compress_s_per_byte: float = 0.0, *, per_node: int = 1, intra: Link | None = None) -> list[float]:
    """Seconds of each DDP bucket's reduction with a cast hook (none, fp16, bf16) around the
    backend's allreduce: the reduction runs on the compressed dtype, plus one compress and one
    decompress per bucket (κ·bytes)."""
    return [comm_time(algorithm, b, p, link, ratio, 0.0, per_node=per_node, intra=intra)
            + (b * compress_s_per_byte if ratio != 1 and p > 1 else 0.0) for b in bucket_bytes]


def predict_iter_ms(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
                    update_s: float = 0.0, width: int = 2, ratio: float = 1.0,
                    compress_s_per_byte: float = 0.0, *, forward_fraction: float = 1 / 3,
                    overlap_slowdown: float = 1.0, bucket_cap_bytes: float | None = DDP_BUCKET_CAP_BYTES,
                    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES, per_node: int = 1,
                    intra: Link | None = None, server_on_worker: bool = False, barrier_s: float = 0.0,
                    buffers: bool = False, sync_every: int = 1) -> float:
    """Predicted milliseconds per steady-state iteration: the one call a training run makes to log
    ``predicted_iter_ms`` next to its measured time. A mode whose reductions overlap backward (ddp)
    uses DDP's bucketing (``bucket_cap_bytes=None``: one bucket), and at a width its row offers (ddp
    at 2: the pipelined hook) Pipe-SGD's :func:`pipelined_time` over those buckets' reductions;
    server modes need ``algorithm="ps"`` (:func:`algorithm_for`); with ``server_on_worker`` the
    server shares a worker's rank (p workers, p-1 remote push/pull pairs through its link). Each of
    the step's :func:`barriers_per_step` (``buffers``: the model's buffers are broadcast every step)
    adds ``barrier_s``. ``sync_every=H``: a round, H steps' compute and updates, is one iteration."""
    compute_s, update_s = sync_every * compute_s, sync_every * update_s
    _, iter_s = _predict_s(mode, algorithm, nbytes, p, link, compute_s, update_s, width, ratio,
                           compress_s_per_byte, forward_fraction=forward_fraction,
                           overlap_slowdown=overlap_slowdown, bucket_cap_bytes=bucket_cap_bytes,
                           first_bucket_bytes=first_bucket_bytes, per_node=per_node, intra=intra,
                           server_on_worker=server_on_worker, barrier_s=barrier_s, buffers=buffers)
    return iter_s * 1e3 / sync_every


def step_time(mode: str, params: int, compute_s: float, link: Link, p: int, *, compressor="none",
              comm: str = "ring", width: int | None = None, backward_fraction: float = 2 / 3, update_s: float = 0.0,
              compress_s_per_byte: float = 0.0, overlap_slowdown: float = 1.0, per_node: int = 1,
              intra: Link | None = None, server_on_worker: bool = True,
              bucket_cap_bytes: float | None = DDP_BUCKET_CAP_BYTES) -> float:
    """Predicted seconds per steady-state step of ``mode`` training an fp32 model of ``params``
    parameters whose forward+backward takes ``compute_s`` (``backward_fraction`` of it backward),
    over ``p`` workers on ``link``, with ``compressor`` (a registered name or an instance) inside
    the allreduce ``comm`` (modes that do not run ``comm`` use what their row declares). Everything
    a scheme contributes comes from what its plugins declare: the mode's overlap and server, the
    allreduce's phases, the compressor's payload size. ``width``: the mode's own by default (a
    pipelined mode's K = 2); ddp at 2 is the pipelined hook."""
    width = width if width is not None else get_mode(mode).width or 2
    algorithm = algorithm_for(mode, comm)
    ratio = compression_ratio(compressor, params, chunks_for(algorithm, p, per_node))
    return predict_iter_ms(mode, algorithm, FP32_BYTES * params, p, link, compute_s, update_s, width, ratio,
                           compress_s_per_byte, forward_fraction=1 - backward_fraction,
                           overlap_slowdown=overlap_slowdown, bucket_cap_bytes=bucket_cap_bytes,
                           per_node=per_node, intra=intra, server_on_worker=server_on_worker) / 1e3


def _reference() -> tuple[str, str]:
    """(mode, allreduce) of the table's baseline as declared (``reference``): sync over the ring."""
    allreduces = registry("allreduce")
    return modes_with("reference")[0], next(n for n in allreduces if allreduces.facts(n).get("reference"))


def _plan(width: int, per_node: int, p: int) -> list[tuple[str, str, int]]:
    """(mode, algorithm, width) of every table row: the modes that reduce, each over every
    registered allreduce whose price differs (one that declares another's cost, as native does the
    ring's, as do native and auto, would repeat its rows; a node-grouped one only when
    1 < per_node < p) that the mode runs (its ``comms``), or what it declares it runs instead."""
    allreduces = registry("allreduce")
    costs, collectives = set(), []
    for name in allreduces:
        cost = allreduces.facts(name)["cost"]
        if cost in costs or (allreduces.facts(name).get("node_groups") and not 1 < per_node < p):
            continue
        costs.add(cost)
        collectives.append(name)
    rows = []
    for mode in modes():
        row = get_mode(mode)
        if row.overlap == "none":
            continue
        runs = [a for a in collectives if row.comms is None or a in row.comms]
        algorithms = runs if row.allreduce else [algorithm_for(mode, collectives[0])]
        rows += [(mode, a, _width(mode, width)) for a in algorithms]
    return rows


def predict(numel: int, p: int, link: Link, compute_s: float, update_s: float = 0.0, width: int = 2,
            compressors: Sequence | None = None, compress_s_per_byte: Mapping[str, float] | None = None,
            *, forward_fraction: float = 1 / 3, overlap_slowdown: float = 1.0, iterations: int | None = None,
            per_node: int = 1, intra: Link | None = None,
            bucket_cap_bytes: float | None = DDP_BUCKET_CAP_BYTES,
            first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES, barrier_s: float = 0.0,
            buffers: bool = False) -> list[dict]:
    """One row per (mode, algorithm, compressor) for an fp32 model of ``numel`` parameters.

    ``compressors``: names or instances (default: every registered compressor, with its defaults).
    Row keys: mode, width, algorithm, compressor, ratio, comm_ms, exposed_ms (iteration − compute −
    update), iter_ms, speedup_vs_sync (against sync/ring/none, the blocking fp32 ring) and, when
    ``iterations`` is given, total_s. A mode that lists its compressors (ddp: DDP's own
    hooks) gets rows for those only. ``barrier_s``, ``buffers``: as :func:`predict_iter_ms`.
    """
    comps = [_compressor(c) for c in (registry("compressor") if compressors is None else compressors)]
    kappas = dict(compress_s_per_byte or {})
    nbytes = FP32_BYTES * numel
    options = dict(forward_fraction=forward_fraction, overlap_slowdown=overlap_slowdown,
                   bucket_cap_bytes=bucket_cap_bytes, first_bucket_bytes=first_bucket_bytes,
                   per_node=per_node, intra=intra, barrier_s=barrier_s, buffers=buffers)
    _, baseline = _predict_s(*_reference(), nbytes, p, link, compute_s, update_s, 1, 1.0, 0.0, **options)
    rows = []
    for mode, algorithm, row_width in _plan(width, per_node, p):
        for comp in comps:
            if not carries(mode, comp):
                continue
            ratio = compression_ratio(comp, numel, chunks_for(algorithm, p, per_node))
            comm, iter_s = _predict_s(mode, algorithm, nbytes, p, link, compute_s, update_s, row_width,
                                      ratio, kappas.get(comp.name, 0.0), **options)
            row = {"mode": mode, "width": row_width, "algorithm": algorithm, "compressor": comp.name,
                   "ratio": ratio, "comm_ms": comm * 1e3,
                   "exposed_ms": max(iter_s - compute_s - update_s, 0.0) * 1e3,
                   "iter_ms": iter_s * 1e3, "speedup_vs_sync": baseline / iter_s if iter_s else math.inf}
            if iterations is not None:
                waits = iterations * barrier_time(barrier_s, mode, row_width, buffers, p)
                row["total_s"] = (total_time(mode, iterations, compute_s, comm, update_s, row_width,
                                             forward_fraction, p=p, overlap_slowdown=overlap_slowdown) + waits
                                  if get_mode(mode).overlap != "backward" else iterations * iter_s)
            rows.append(row)
    return rows
