"""The benchmark grid: which cells exist, what each one runs, and how a subset is chosen.

A cell is one measured configuration. ``train`` cells run ``python -m pipesgd.train`` (through
``python -m pipesgd_lab.emulate`` on a shaped link) and measure iteration time; ``allreduce`` cells
time one collective of a fixed size (pipesgd_lab/bench/allreduce.py). Names are
``<model>/p<workers>/<link>/<mode>[-<compressor>]`` and ``allreduce/p<workers>/<link>/<algo>-<size>``,
so ``--only 'resnet20/p2/*'`` or ``--only '*/100mbit/*'`` select slices. :data:`GRIDS` names the
grids the bench can run (``--grid``): the suite, and the ring at larger p (docs/ring-scaling.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

from pipesgd.modes import get_mode
from pipesgd.timing import MODEL_PARAMS

LOOPBACK = "loopback"
LINKS = (LOOPBACK, "1gbit", "100mbit")
WORLD_SIZES = (2, 4)


@dataclass(frozen=True)
class Workload:
    """A model at a per-worker batch size, as training overrides and as calibrate arguments."""

    label: str
    experiment: str
    model: str  # conf/model name
    params: int  # trainable parameters (10 classes), for sizes and the timing model
    model_overrides: tuple[str, ...] = ()  # keys relative to the model config, e.g. "hidden=[1024,256]"
    batch_size: int = 32

    @property
    def train_overrides(self) -> list[str]:
        return [f"+experiment={self.experiment}", f"data.batch_size={self.batch_size}",
                *(f"model.{o}" for o in self.model_overrides)]


RESNET20 = Workload("resnet20", "resnet_cifar", "resnet20", MODEL_PARAMS["resnet20"])
MLP1M = Workload("mlp1m", "mnist_mlp", "mlp", 1_068_810, ("hidden=[1024,256]",))
"""~1.07M parameters (4.3 MB of fp32 gradient) for ~1 ms of compute: the communication-bound cell."""
MLP = Workload("mlp", "mnist_mlp", "mlp", MODEL_PARAMS["mlp"])
"""Not in the grid: the smallest real training run, for testing the suite itself."""
WORKLOADS = {w.label: w for w in (RESNET20, MLP1M, MLP)}


@dataclass(frozen=True)
class Cell:
    kind: str  # "train" | "allreduce"
    mode: str  # train: sync | pipe | ddp | local; allreduce: a registered pipesgd.comm allreduce (ring, tree, native)
    world_size: int
    link: str  # "loopback" or a tc rate such as "100mbit"
    compressor: str = "none"
    width: int = 1
    workload: str = "resnet20"
    nbytes: int = 0  # allreduce cells: tensor bytes (fp32)
    comm: str = "ring"  # train cells: conf/comm (ring, tree, hierarchical); the ps modes ignore it
    group_size: int | None = None  # comm=hierarchical: ranks per node group
    calibrated_at: int | None = None  # allreduce cells: the p whose calibration gives α, β, γ (None: the cell's)
    extra: tuple[str, ...] = ()  # train cells: further overrides, not in the name (e.g. the compressor's settings)

    @property
    def train_overrides(self) -> list[str]:
        """The cell's own training overrides (the workload's come from :class:`Workload`)."""
        out = [f"trainer.mode={self.mode}", f"trainer.width={max(self.width, 1)}", f"compressor={self.compressor}",
               f"comm={self.comm}", f"dist.nproc={self.world_size}",
               # The paper's rule, whatever the experiment file's (resnet_cifar: staleness=lookahead).
               "staleness=none"]
        return out + ([f"comm.group_size={self.group_size}"] if self.group_size else []) + list(self.extra)

    @property
    def name(self) -> str:
        if self.kind == "allreduce":
            return f"allreduce/p{self.world_size}/{self.link}/{self.mode}-{_size(self.nbytes)}"
        via = "" if self.comm == "ring" else f"+{self.comm}"
        arm = arm_name(self.mode, self.compressor, self.width)
        return f"{self.workload}/p{self.world_size}/{self.link}/{arm.replace(self.mode, self.mode + via, 1)}"

    @property
    def emulated(self) -> bool:
        return self.link != LOOPBACK

    @property
    def calibration_key(self) -> tuple[str, int, str]:
        """(workload, p, link) whose calibration predicts this cell; allreduce cells only need the
        link constants, taken from the ResNet-20 calibration of the same link at ``calibrated_at``
        workers (default the cell's own p)."""
        if self.kind == "train":
            return (self.workload, self.world_size, self.link)
        return (RESNET20.label, self.calibrated_at or self.world_size, self.link)


def arm_name(mode: str, compressor: str, width: int) -> str:
    """How a cell's arm is named: its mode, ``-pipelined`` where a mode of fixed width runs at
    another it offers (ddp at width 2: the pipelined DDP hook), and ``-<compressor>`` when it
    compresses: ``ddp-fp16``, ``ddp-pipelined-powersgd``."""
    row = get_mode(mode)
    label = f"{mode}-pipelined" if row.width is not None and width in row.widths else mode
    return label if compressor == "none" else f"{label}-{compressor}"


def _size(nbytes: int) -> str:
    if nbytes < 1_000_000:
        return f"{nbytes / 1e3:g}KB"
    return f"{nbytes / 1e6:.2f}MB".replace(".00MB", "MB")


TRAIN_MODES = (("sync", "none"), ("pipe", "none"), ("pipe", "fp16"), ("pipe", "bf16"), ("pipe", "int8"),
               ("ddp", "none"), ("ddp", "fp16"))


# The seed papers' systems as modes, where they differ from the ring: at 100 Mbit.
# Hierarchical needs nodes of more than one rank: p=4 as 2 groups of 2 (every link is shaped alike
# here, so it measures the extra intra-group hops, not a faster intra-node fabric).
SEED_MODES = (("sync", "tree"), ("pipe", "tree"), ("ps_sync", "ring"), ("ps_async", "ring"))
HIERARCHICAL = (("sync", "hierarchical"), ("pipe", "hierarchical"))
SEED_LINK = "100mbit"


def _train(mode: str, compressor: str, p: int, link: str, workload: str = "resnet20", comm: str = "ring",
           group_size: int | None = None, extra: tuple[str, ...] = ()) -> Cell:
    return Cell("train", mode, p, link, compressor, get_mode(mode).width or 2, workload, comm=comm,
                group_size=group_size, extra=extra)  # width 2 for the pipelined mode, the mode's own for the others


def full_grid() -> list[Cell]:
    """Every cell of the suite (docs/benchmarks.md), in run order (loopback first, then each emulated link)."""
    cells: list[Cell] = []
    resnet_bytes, mlp_bytes = 4 * RESNET20.params, 4 * MLP1M.params
    for link in LINKS:
        for p in WORLD_SIZES:
            if link == LOOPBACK:
                # Compute-only baseline: same processes and threads, no communication at all.
                cells.append(_train("local", "none", p, link))
            cells += [_train(mode, comp, p, link) for mode, comp in TRAIN_MODES]
            if link == SEED_LINK:
                cells += [_train(mode, "none", p, link, comm=comm) for mode, comm in SEED_MODES]
                if p == 4:
                    cells += [_train(mode, "none", p, link, comm=comm, group_size=2) for mode, comm in HIERARCHICAL]
            for nbytes in (resnet_bytes, 8_000_000):
                cells += [Cell("allreduce", algo, p, link, nbytes=nbytes) for algo in ("ring", "native")]
    # Communication-bound: ~1M parameters at 100 Mbit (compute ~1 ms, allreduce ~360 ms).
    cells += [_train("local", "none", 2, LOOPBACK, "mlp1m")]
    cells += [_train(mode, comp, 2, "100mbit", "mlp1m") for mode, comp in
              (("sync", "none"), ("pipe", "none"), ("pipe", "int8"))]
    cells += [Cell("allreduce", "ring", 2, "100mbit", nbytes=mlp_bytes)]
    return cells


def quick_grid() -> list[Cell]:
    """A slice that exercises every kind of cell in a few minutes: p = 2, loopback and 100mbit."""
    keep = {"resnet20/p2/loopback/local", "resnet20/p2/loopback/pipe", "resnet20/p2/loopback/sync",
            "resnet20/p2/100mbit/sync", "resnet20/p2/100mbit/pipe", "resnet20/p2/100mbit/pipe-int8",
            "resnet20/p2/100mbit/ddp", f"allreduce/p2/100mbit/ring-{_size(4 * RESNET20.params)}",
            f"allreduce/p2/100mbit/native-{_size(4 * RESNET20.params)}"}
    return [c for c in full_grid() if c.name in keep]


RING_SCALING_ALGOS = ("ring", "tree", "native")
"""pipesgd's ring, FireCaffe's binomial tree, Gloo's own allreduce: each priced by the cost it declares."""
RING_SCALING_WORLD_SIZES = (4, 8, 16)
RING_SCALING_LINKS = ("100mbit", "1gbit")
RING_SCALING_BYTES = (1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000)
"""1 MB to 100 MB in half-decade steps: the small ones show α (2(p−1) messages), the large ones β."""


def ring_scaling_grid() -> list[Cell]:
    """Communication alone at larger p (docs/ring-scaling.md): every algorithm of
    :data:`RING_SCALING_ALGOS` at every p, link and size, slow link first, small sizes first.

    Every cell predicts from the p=2 calibration of its link: α and β are measured between ranks 0
    and 1 whatever p is, and a calibration at p=16 would time sixteen ResNet-20s on this machine's
    cores for constants these cells do not read."""
    return [Cell("allreduce", algo, p, link, nbytes=nbytes, calibrated_at=2)
            for link in RING_SCALING_LINKS for p in RING_SCALING_WORLD_SIZES for nbytes in RING_SCALING_BYTES
            for algo in RING_SCALING_ALGOS]


CROSSOVER_RATES = ("25mbit", "50mbit", "100mbit", "200mbit", "500mbit", "1gbit")
CROSSOVER_ARMS = (("local", "none"), ("sync", "none"), ("ddp", "none"), ("ddp", "fp16"), ("ddp", "powersgd"),
                  ("pipe", "none"), ("pipe", "fp16"), ("pipe", "int8"))
"""Compute alone, the blocking ring, DDP with no hook / torch's fp16 hook / torch's PowerSGD hook,
and Pipe-SGD (K = 2) with no, fp16 or int8 compression: the arms of pipesgd.timing.scale.ARMS plus local."""
POWERSGD_DDP = ("compressor.rank=2", "compressor.ddp_start_iter=2")
"""ddp-powersgd as the map prices it (rank 2), compressing from the third step: with torch's default
1000 plain steps first, a timing run of a few dozen steps would time plain DDP."""


CROSSOVER_PIPELINED_DDP = ("none", "fp16", "powersgd")
"""DDP with the pipelined hook (``trainer.mode=ddp trainer.width=2``: Pipe-SGD of width 2 inside DDP,
pipesgd.hooks) around DDP's allreduce, torch's fp16 hook and torch's PowerSGD hook."""


def crossover_grid() -> list[Cell]:
    """The crossover sweep (docs/crossover.md): ResNet-20 at p = 2 and 4, every arm at every rate, in
    run order (p, then rate, then arm); run with interleaved rounds."""
    def extra(comp: str) -> tuple[str, ...]:
        return POWERSGD_DDP if comp == "powersgd" else ()

    return [cell for p in WORLD_SIZES for rate in CROSSOVER_RATES for cell in (
        *(_train(mode, comp, p, rate, extra=extra(comp)) for mode, comp in CROSSOVER_ARMS),
        *(replace(_train("ddp", comp, p, rate, extra=extra(comp)), width=2) for comp in CROSSOVER_PIPELINED_DDP))]


GRIDS = {"full": full_grid, "ring-scaling": ring_scaling_grid, "crossover": crossover_grid}
"""``--grid`` name -> the cells it holds, in run order."""


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    """Cells whose name matches any of the comma-separated shell patterns in ``only``.

    Raises ValueError naming a pattern that matches nothing (a typo should not run an empty suite).
    """
    if not only:
        return cells
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(c.name, pattern) for c in cells):
            raise ValueError(f"--only pattern {pattern!r} matches no cell; names look like "
                             f"{cells[0].name!r} (see --list)")
    return [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
