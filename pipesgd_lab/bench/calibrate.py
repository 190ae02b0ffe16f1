"""``python -m pipesgd_lab.bench.calibrate_cli``: measure the cost model's constants on a real process group.

Run on the machines (or the emulated cluster) the prediction is for; every rank takes part::

    python -m pipesgd_lab.bench.calibrate_cli --workers 2 --model resnet20 --batch-size 32 --out cal.json
    python -m pipesgd_lab.emulate --workers 2 --rate 100mbit --module pipesgd_lab.bench.calibrate_cli -- \\
        --model resnet20 --batch-size 32          # -> <emulate run dir>/calibration.json

What is measured, in order (ranks that do not take part in a step wait at a barrier, so each
number is taken on an otherwise idle group):

1. α, β: ping-pong between ranks 0 and 1 over Gloo ``send``/``recv`` for a sweep of message sizes;
   the one-way time t(n) = round trip / 2 is fitted to t = α + n·β (β: least-squares slope over the
   sweep; α: the smallest message's time minus its n·β, i.e. the small-message latency).
2. γ: ``a.add_(b)`` on fp32 ring chunks (M/p values) on rank 0, seconds per byte.
3. κ: ``compress`` + ``decompress`` of every registered compressor on the same chunk, per
   uncompressed byte; and ``powersgd_s_per_flop``: PowerSGD's own compute (its matmuls, QR and
   error feedback: the ``powersgd`` reduction bound to the model's parameters at rank
   :data:`POWERSGD_RANK`, with an allreduce that sends nothing) per FLOP it declares
   (``step_flops``), the constant the map prices DDP + PowerSGD's compute with.
4. compute and update: forward+backward (``compute_ms``) and an SGD-momentum step (``update_ms``)
   of the named model on random inputs of the named dataset's shape, on every rank at once
   (as in training, the ranks share the machine's cores), mean over ranks of each rank's median.
5. ``overlap_slowdown``: the same forward+backward while ring allreduces of the model's gradient
   run back to back on a background thread (the engine's comm thread), divided by 4.'s compute
   time (median over ranks of each rank's ratio). Only steps that start and end while a
   reduction is running are counted. 4. and 5. alternate in ``rounds`` (default 3), so
   drifting background load biases both alike.
6. ``barrier_s``: what a blocking collective costs a step beyond its bytes: the same
   forward+backward followed by an allreduce of one value, minus 4.'s compute (each rank's
   medians; mean over ranks, so a rank that is always faster, and always waits, counts as in a
   run, whose step the slower rank sets). It prices the ranks' step-to-step jitter and the
   collective's latency, paid at every barrier a step has
   (:func:`pipesgd.timing.model.barriers_per_step`: DDP's broadcast of BatchNorm buffers before
   forward and its gradient after backward are two). Timed in the same rounds as 4. and 5.
7. For reference, the ring allreduce of the model's gradient alone (``measurements.ring_ms``) next
   to what the fitted α, β, γ predict for it.

The JSON has the keys :func:`pipesgd.timing.load_calibration` reads plus ``model_params`` and
``batch_size`` (a training run of that model at that batch then predicts from the calibrated
compute) and the raw measurements. CPU only (Gloo).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from pipesgd.observability.runinfo import git_commit, write_json_atomic

from pipesgd.timing.model import allreduce_time

log = logging.getLogger(__name__)

# The packaged configs (pipesgd/conf: the clone's conf/ itself, or the copy a wheel installed).
CONF_DIR = Path(str(resources.files("pipesgd") / "conf"))
DEFAULT_SIZES = (4, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20)
# --quick: 32 MiB takes ~10 ms on loopback, far above a loaded moment's latency noise (4 MiB once
# timed below 4 B, and the fitted slope came out negative).
QUICK_SIZES = (4, 1 << 20, 32 << 20)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20}


class CalibrationError(RuntimeError):
    """A measurement that cannot give a sane constant (the message says which and why)."""


@dataclass(frozen=True)
class CalibrationSpec:
    """What to measure. ``model``/``data`` name conf/model and conf/data files;
    ``model_overrides`` are ``key=value`` strings applied to the model config (e.g. ``hidden=[1024,256]``)."""

    model: str = "resnet20"
    data: str | None = None
    model_overrides: tuple[str, ...] = ()
    batch_size: int = 32
    threads: int = 1
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    warmup: int = 3
    overlap_steps: int = 10
    rounds: int = 3
    timeout_s: float = 300.0
    command: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        models = available("model")
        if self.model not in models:
            raise ValueError(f"model={self.model!r} is not in conf/model; allowed: {', '.join(models)}")
        if self.data is not None and self.data not in available("data"):
            raise ValueError(f"data={self.data!r} is not in conf/data; allowed: {', '.join(available('data'))}")
        for name in ("batch_size", "threads", "repeats", "overlap_steps", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if len(self.sizes) < 2 or any(s < 1 for s in self.sizes) or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes must be at least two distinct byte counts >= 1, got {list(self.sizes)}")
        if min(self.sizes) > 1024:
            raise ValueError(f"sizes must include a small message (<= 1 KiB) to measure α, got {list(self.sizes)}")

    @property
    def dataset(self) -> str:
        """The dataset whose input shape the model is fed: given, or MNIST for the MNIST models."""
        return self.data or ("mnist" if self.model in ("mlp", "cnn") else "cifar10")


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def parse_size(text: str) -> int:
    """``"4"``, ``"64k"``, ``"4m"`` (binary: KiB, MiB) -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    if not digits or unit not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r}: expected a number of bytes with optional k or m (KiB, MiB)")
    value = float(digits) * _SIZE_UNITS[unit]
    if value < 1 or value != int(value):
        raise ValueError(f"bad size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


# --- pure measurement helpers (one process) ------------------------------------------------------


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(α, β) of t = α + n·β: β the least-squares slope over the sweep; α the median of t − n·β over
    the latency-bound sizes (n·β at most half of t; the smallest size always counts).

    The intercept of the least-squares line is not used for α: the large messages dominate it and
    their noise can make it negative; the small-message time is what α means.
    Raises CalibrationError if β or α is not positive (sizes too close together to see bandwidth).
    """
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    if not beta > 0:
        raise CalibrationError(f"fitted β = {beta:.3g} s/B is not positive: time did not grow with size over "
                               f"{list(sizes)} B (one-way {[f'{s * 1e6:.1f}us' for s in seconds]}); "
                               "use larger --sizes")
    smallest = min(sizes)
    latency_bound = [t - x * beta for x, t in zip(sizes, seconds) if x == smallest or x * beta <= t / 2]
    alpha = statistics.median(latency_bound)
    if not alpha > 0:
        raise CalibrationError(f"α = {alpha:.3g} s is not positive: the small messages took less than n·β "
                               f"(one-way {[f'{s * 1e6:.1f}us' for s in seconds]} for {list(sizes)} B); "
                               "use a smaller first size")
    return alpha, beta


def _median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def reduction_cost(numel: int, repeats: int) -> float:
    """γ: seconds per byte of ``a.add_(b)`` on fp32 vectors of ``numel`` values."""
    import torch

    a, b = torch.randn(numel), torch.randn(numel)
    return _median_time(lambda: a.add_(b), repeats) / (4 * numel)


def compress_costs(numel: int, repeats: int) -> dict[str, float]:
    """κ per registered compressor: compress + decompress seconds per uncompressed fp32 byte."""
    import torch

    from pipesgd.compress import available as compressors
    from pipesgd.compress import get_compressor

    chunk = torch.randn(numel)
    out = {}
    for name in compressors():
        if name == "none":
            continue
        comp = get_compressor(name)

        def round_trip(comp=comp) -> None:
            payload, ctx = comp.compress(chunk)
            comp.decompress(payload, ctx)

        out[name] = _median_time(round_trip, repeats) / (4 * numel)
    return out


POWERSGD_RANK = 2
"""The rank PowerSGD's compute is calibrated at (the time-to-accuracy and crossover studies' rank)."""


def powersgd_cost(shapes: Sequence[Sequence[int]], repeats: int, group=None,
                  rank: int = POWERSGD_RANK) -> tuple[float, float]:
    """(seconds per declared FLOP, seconds per step) of PowerSGD's compute on a model of parameter
    ``shapes``: the real reduction, bound with an allreduce that sends nothing, so only its own
    work is timed (``group``: any initialised process group; it is asked its size only)."""
    import torch

    from pipesgd.comm import CommStats
    from pipesgd.reduction.powersgd import PowerSGD

    red = PowerSGD(rank=rank)
    red.bind([torch.Size(s) for s in shapes], lambda buf, chunk, group: CommStats(), torch.device("cpu"))
    if not red.bound_flops():
        raise CalibrationError(f"PowerSGD at rank {rank} compresses none of the model's {len(shapes)} tensors")
    flat = torch.randn(sum(math.prod(s) for s in shapes))
    seconds = _median_time(lambda: red.reduce(flat, group), repeats, warmup=2)
    return seconds / red.bound_flops(), seconds


def build_model(spec: CalibrationSpec):
    """(model, inputs, labels) of the configured model on random data of the dataset's shape."""
    import torch
    from hydra.utils import get_class, instantiate
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / f"{spec.model}.yaml"),
                                OmegaConf.from_dotlist(list(spec.model_overrides)))
    data_cls = get_class(OmegaConf.load(CONF_DIR / "data" / f"{spec.dataset}.yaml")._target_)
    model = instantiate(model_cfg, num_classes=data_cls.num_classes, in_channels=data_cls.in_channels,
                        image_size=data_cls.image_size)
    x = torch.randn(spec.batch_size, data_cls.in_channels, data_cls.image_size, data_cls.image_size)
    y = torch.randint(0, data_cls.num_classes, (spec.batch_size,))
    return model, x, y


class _Step:
    """forward+backward and the optimizer step of one training iteration, timed separately."""

    def __init__(self, model, x, y):
        import torch

        self.model, self.x, self.y = model, x, y
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The project's default optimizer (conf/optimizer/sgd.yaml): SGD with momentum.
        self.optimizer = torch.optim.SGD(self.params, lr=1e-3, momentum=0.9)

    def compute(self) -> float:
        import torch.nn.functional as F

        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(self.model(self.x), self.y).backward()
        return time.perf_counter() - t0

    def update(self) -> float:
        t0 = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - t0


# --- the per-rank measurement --------------------------------------------------------------------


def _pingpong(sizes: Sequence[int], repeats: int, peer: int, first: bool) -> list[float]:
    """Median one-way seconds per size (round trip / 2 on the first rank's clock).

    Sizes are interleaved (one round trip of each size per repetition) so that a change in
    background load shifts every size alike instead of biasing the fitted slope; largest first,
    because a small message right after a large one was measured 3x slower than after another
    small one (the large transfer's tail still occupies both ends).
    """
    import torch

    from pipesgd.comm.pingpong import round_trip

    bufs = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    samples: list[list[float]] = [[] for _ in sizes]
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    for rep in range(repeats + 2):  # two warm-up rounds (connections, socket buffers)
        for i in order:
            seconds = round_trip(bufs[i], peer, first)
            if rep >= 2:
                samples[i].append(seconds / 2)
    return [statistics.median(s) for s in samples]


def _synced_compute(step: _Step, one, group) -> float:
    """Seconds of one forward+backward followed by an allreduce of ``one`` (a single value): the
    step as a rank sees it when it must wait for every peer at its end; then the update."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    step.compute()
    dist.all_reduce(one, group=group)
    seconds = time.perf_counter() - t0
    step.update()
    return seconds


def _overlapped_compute(step: _Step, flat, group, n_reductions: int, max_steps: int) -> list[float]:
    """forward+backward seconds of steps run entirely while ``n_reductions`` ring allreduces of
    ``flat`` run back to back on a background thread (every rank runs the same number)."""
    from pipesgd.comm.ring import ring_allreduce

    running = threading.Event()
    running.set()
    errors: list[BaseException] = []

    def reduce_loop() -> None:
        try:
            for _ in range(n_reductions):
                ring_allreduce(flat, None, group)
        except BaseException as e:  # re-raised in the caller's thread below
            errors.append(e)
        finally:
            running.clear()

    thread = threading.Thread(target=reduce_loop, name="calibrate-comm", daemon=True)
    thread.start()
    samples = []
    while running.is_set() and len(samples) < max_steps:
        seconds = step.compute()
        step.update()
        if running.is_set():
            samples.append(seconds)
    thread.join()
    if errors:
        raise errors[0]
    return samples


def measure(spec: CalibrationSpec, rank: int, world: int, comm_group) -> dict | None:
    """Run every measurement on this rank of an initialised Gloo group; rank 0 returns the
    calibration dict, other ranks None."""
    import torch
    import torch.distributed as dist

    from pipesgd.comm.ring import ring_allreduce

    if world < 2:
        raise CalibrationError("calibrate needs at least 2 workers (α and β are measured between ranks 0 and 1)")
    torch.manual_seed(rank)
    model, x, y = build_model(spec)
    step = _Step(model, x, y)
    numel = sum(p.numel() for p in step.params)
    chunk = max(numel // world, 1)
    repeats = spec.repeats

    dist.barrier()
    one_way = _pingpong(spec.sizes, repeats, 1 - rank, rank == 0) if rank < 2 else []
    dist.barrier()
    gamma, kappas, powersgd = 0.0, {}, (0.0, 0.0)
    if rank == 0:
        gamma, kappas = reduction_cost(chunk, 5 * repeats), compress_costs(chunk, 3 * repeats)
        powersgd = powersgd_cost([tuple(p.shape) for p in step.params], repeats, comm_group)
    dist.barrier()

    for _ in range(spec.warmup):
        step.compute()
        step.update()
    flat = torch.zeros(numel)
    ring_allreduce(flat, None, comm_group)  # warm-up: connections of the comm group

    # Alone and overlapped compute alternate in rounds, so that a change in the machine's load
    # (other jobs on shared cores) biases both alike instead of the slowdown ratio.
    rounds = max(1, min(spec.rounds, repeats, spec.overlap_steps))
    compute, update, overlapped, synced = [], [], [], []
    one = torch.zeros(1)
    n_reductions = ring_s = 0
    for i in range(rounds):
        dist.barrier()
        for _ in range(math.ceil(repeats / rounds)):
            compute.append(step.compute())
            update.append(step.update())
        dist.barrier()
        for _ in range(math.ceil(repeats / rounds)):
            synced.append(_synced_compute(step, one, comm_group))
        if i == 0:
            dist.barrier()
            ring = [_median_time(lambda: ring_allreduce(flat, None, comm_group), 1, warmup=0)
                    for _ in range(max(3, repeats // 2))]
            ring_s = statistics.median(ring)
            # Enough back-to-back reductions to cover a round's overlapped steps with margin; every
            # rank must run the same number, so rank 0 decides.
            per_round = math.ceil(spec.overlap_steps / rounds)
            step_s = statistics.median(compute) + statistics.median(update)
            box = [min(10_000, math.ceil(1.5 * per_round * step_s / ring_s) + 2)]
            dist.broadcast_object_list(box, src=0)
            n_reductions = box[0]
        dist.barrier()
        overlapped += _overlapped_compute(step, flat, comm_group, n_reductions,
                                          math.ceil(spec.overlap_steps / rounds))
    if not overlapped:
        raise CalibrationError(f"rank {rank}: no compute step fitted inside {n_reductions} ring allreduces "
                               f"({ring_s * 1e3:.2f} ms each); raise --overlap-steps")
    compute_s, update_s = statistics.median(compute), statistics.median(update)

    mine = {"rank": rank, "compute_ms": compute_s * 1e3, "update_ms": update_s * 1e3,
            "ring_ms": ring_s * 1e3, "overlapped_compute_ms": statistics.median(overlapped) * 1e3,
            "overlapped_steps": len(overlapped), "synced_compute_ms": statistics.median(synced) * 1e3}
    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None

    alpha, beta = fit_alpha_beta(spec.sizes, one_way)
    mean = lambda key: statistics.fmean(r[key] for r in everyone)  # noqa: E731
    # Median over ranks of each rank's ratio: one rank descheduled during its few overlapped steps
    # (a shared machine) must not set the slowdown of all.
    raw_slowdown = statistics.median(r["overlapped_compute_ms"] / r["compute_ms"] for r in everyone)
    raw_barrier_s = statistics.fmean(r["synced_compute_ms"] - r["compute_ms"] for r in everyone) / 1e3
    nbytes = 4 * numel
    return {
        "alpha_s": alpha, "beta_s_per_byte": beta, "gamma_s_per_byte": gamma, "compress_s_per_byte": kappas,
        "powersgd_s_per_flop": powersgd[0], "powersgd_rank": POWERSGD_RANK, "powersgd_step_ms": powersgd[1] * 1e3,
        "compute_ms": mean("compute_ms"), "update_ms": mean("update_ms"),
        # < 1 only by noise (compute cannot speed up because a reduction runs beside it).
        "overlap_slowdown": max(1.0, raw_slowdown),
        # < 0 only by noise (waiting for a peer cannot make a step shorter).
        "barrier_s": max(0.0, raw_barrier_s),
        "model": spec.model, "model_overrides": list(spec.model_overrides), "model_params": numel,
        "batch_size": spec.batch_size, "data": spec.dataset, "workers": world, "threads": spec.threads,
        "link": os.environ.get("PIPESGD_EMULATED_LINK", "loopback"),
        "bandwidth_mbit_s": 8 / beta / 1e6,
        "measurements": {
            "sizes_bytes": list(spec.sizes), "one_way_s": one_way,
            "fit_one_way_s": [alpha + n * beta for n in spec.sizes], "repeats": repeats,
            "overlap_slowdown_raw": raw_slowdown, "barrier_s_raw": raw_barrier_s, "per_rank": everyone,
            "ring_bytes": nbytes, "ring_ms": mean("ring_ms"),
            "ring_predicted_ms": allreduce_time("ring", nbytes, world, alpha, beta, gamma) * 1e3,
        },
        "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()},
        "commit": git_commit(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _worker(spec: CalibrationSpec, out: str) -> None:
    """One rank: join the group, measure, rank 0 writes ``out``; the group is destroyed in one place."""
    import torch

    from pipesgd import dist as pdist

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    torch.set_num_threads(spec.threads)
    ctx = pdist.init("gloo", spec.timeout_s)
    try:
        result = measure(spec, ctx.rank, ctx.world_size, ctx.comm_group)
        if result is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out, result)
            log.info("calibration written to %s: α %.3g s, β %.3g s/B (%.1f Mbit/s), γ %.3g s/B, compute %.2f ms, "
                     "update %.2f ms, overlap slowdown %.3f", out, result["alpha_s"], result["beta_s_per_byte"],
                     result["bandwidth_mbit_s"], result["gamma_s_per_byte"], result["compute_ms"],
                     result["update_ms"], result["overlap_slowdown"])
    finally:
        pdist.destroy()


def calibrate(spec: CalibrationSpec, out: str | os.PathLike, workers: int) -> dict:
    """Measure on ``workers`` local processes (or, under torchrun/emulate, on the job this process
    belongs to) and return the calibration rank 0 wrote to ``out``."""
    import json

    from pipesgd import launch

    out = os.fspath(Path(out).resolve())
    launch.run(_worker, (spec, out), nproc=workers)
    if launch.under_torchrun() and os.environ.get("RANK") != "0":
        return {}
    return json.loads(Path(out).read_text())
