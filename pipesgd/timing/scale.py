"""The scale map: each scheme's predicted step time on a cluster, the winner, and how much the best
pipelined arm gains over the best DDP arm (``python -m pipesgd.timing map``, docs/scale-map.md).

The arms are built from the registries, not named here: every mode that reduces over an allreduce,
at each width it runs, with every compressor it carries whose cost a plugin declares, one arm per
distinct cost (:func:`arm_table`). What an arm costs is what its plugins declare: the mode's row
its overlap and width, a per-chunk compressor its payload size (``payload_bytes``), a DDP hook that
runs allreduces of its own its traffic per bucket (``ddp_traffic``: torch's ``powerSGD_hook``,
three allreduces one after another and the FLOPs of its matmuls and QR, priced at the measured
``powersgd_s_per_flop``). Every arm but those is a :func:`~pipesgd.timing.model.predict_iter_ms`
call, the function the ``predict`` table and every training run's ``predicted_iter_ms`` use; DDP's
buckets are overlapped with backward by :func:`~pipesgd.timing.model.ddp_iteration_time`, and DDP
with the pipelined hook (width 2) is :func:`~pipesgd.timing.model.pipelined_time` over the same
buckets' reductions: one model, not two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..modes import carries, get_mode
from ..registry import registry
from .model import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    FP32_BYTES,
    Link,
    barrier_time,
    chunks_for,
    comm_time,
    compression_ratio,
    ddp_buckets,
    ddp_iteration_time,
    pipelined_time,
    predict_iter_ms,
)
from .presets import BACKWARD_SHARE, Shape
from .rounds import hides, replica_terms, round_iter_ms, smallest_h, streaming_schedule

PIPELINE_WIDTH = 2
"""The width the map runs a pipelined mode (``trainer.width``) at: Pipe-SGD's K = 2, the width at
which it reaches its bound (more width adds staleness, not speed: docs/timing-model.md)."""
_PROBE = (1, 7, 1000, 4099)
"""Sizes (values) at which two compressors' declared payloads must agree to cost the same."""


class Arm(NamedTuple):
    mode: str
    width: int
    compressor: str


def _instances() -> list:
    """Every compressor and reduction, built with its defaults (what a mode carries is decided on one)."""
    return [registry(kind).get(name)() for kind in ("compressor", "reduction") for name in registry(kind)]


def _price(compressor, overlap: str):
    """What ``compressor`` declares its cost by under a mode of ``overlap`` (a hashable key, equal
    for two compressors that cost the same), or None when it declares none the map prices:
    ``ddp_traffic`` (a DDP hook with allreduces of its own) under DDP's buckets, else the payload
    of a per-chunk compressor."""
    traffic = registry("reduction").facts(compressor.name).get("ddp_traffic") \
        if compressor.name in registry("reduction") else None
    if traffic is not None:
        return ("traffic", traffic) if overlap == "backward" else None
    if compressor.name in registry("reduction"):
        return None
    return ("payload", compressor.identity, tuple(compressor.payload_bytes(n, FP32_BYTES) for n in _PROBE))


def _name(mode: str, width: int, own_width: int, compressor: str) -> str:
    parts = [mode, *(["pipelined"] if width != own_width else []), *([compressor] if compressor != "none" else [])]
    return "-".join(parts)


def arm_table() -> dict[str, Arm]:
    """Every arm the map can price, from the registries: each mode that reduces over an allreduce
    (no server; ``overlap`` not ``"none"``), at its own width (a pipelined mode at
    :data:`PIPELINE_WIDTH`) and each width its row also runs at (``widths``: ddp at 2, the pipelined
    hook), with each compressor it carries that declares a cost (:func:`_price`). One arm per
    distinct (overlap, width, cost): the most exact compressor of that cost (``rel_error``: fp16,
    not bf16), then the first mode registered (pipe, not live). A width-1 pipeline arm is the
    uncompressed reference only (sync): with a compressor it is never faster than the same
    compressor at width 2 (compute + comm >= max(compute, comm)), so it cannot win a cell. Width-1
    arms first, then the pipelined ones, each in registration order; named
    ``mode[-pipelined][-compressor]`` (``-pipelined``: a width other than the mode's own)."""
    chosen: dict[tuple, tuple] = {}
    comps = _instances()
    for mi, mode in enumerate(registry("mode")):
        row = get_mode(mode)
        if row.server or row.overlap == "none":
            continue
        own = row.width or PIPELINE_WIDTH
        for width in (own, *row.widths):
            for ci, comp in enumerate(comps):
                price = _price(comp, row.overlap)
                if price is None or not carries(mode, comp) or (row.overlap == "pipeline" and width == 1
                                                                 and not comp.identity):
                    continue
                key = (row.overlap, width, price)
                exact = comp.rel_error if price[0] == "payload" and comp.rel_error is not None else math.inf
                rank = (exact, mi, ci)
                if key not in chosen or rank < chosen[key][0]:
                    chosen[key] = (rank, (width, mi, ci), _name(mode, width, own, comp.name),
                                   Arm(mode, width, comp.name))
    return {name: arm for _, _, name, arm in sorted(chosen.values(), key=lambda v: v[1])}


ALL_ARMS: dict[str, Arm] = arm_table()
"""Every arm the map prices (:func:`arm_table`): width 1 first, then the pipelined arms."""
ARMS: dict[str, Arm] = {name: arm for name, arm in ALL_ARMS.items()
                        if arm.width == (get_mode(arm.mode).width or PIPELINE_WIDTH)}
"""The map's arms by default: each mode at its own width (the blocking fp32 ring, DDP with no hook /
torch's fp16 hook / torch's PowerSGD hook, Pipe-SGD at K = 2 with no, fp16 or int8 compression
inside the ring); the arms of DDP's pipelined hook are in :data:`ALL_ARMS` (``map --arms``)."""


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
    barrier_s: float = 0.0
    """What each blocking collective costs a step beyond its bytes (``calibrate`` measures it;
    :func:`~pipesgd.timing.model.barriers_per_step`); 0: not modelled."""
    buffers: bool = False
    """The model has buffers (BatchNorm statistics) broadcast every step: one more barrier a step."""
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
                            ("powersgd_s_per_flop", self.powersgd_s_per_flop), ("barrier_s", self.barrier_s)):
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


def _arm_ms(s: Scenario, arm: Arm, algorithm: str) -> tuple[float, float]:
    """(iteration ms, wire compression ratio) of one arm over one algorithm, from what its mode and
    compressor declare (:func:`_price`)."""
    row = get_mode(arm.mode)
    comp = registry("reduction" if arm.compressor in registry("reduction") else "compressor").get(arm.compressor)()
    price = _price(comp, row.overlap)
    options = _options(s, algorithm)
    if price[0] == "payload":
        ratio = compression_ratio(comp, s.params, chunks_for(algorithm, s.p, options["per_node"]))
        kappa = s.compress_s_per_byte.get(arm.compressor, 0.0) if not comp.identity else 0.0
        return predict_iter_ms(arm.mode, algorithm, s.nbytes, s.p, s.link, s.compute_s, s.update_s, arm.width,
                               ratio, kappa, barrier_s=s.barrier_s, buffers=s.buffers, **options), ratio
    # a DDP hook's own allreduces, one after another, and its compute between them
    sizes = ddp_buckets(s.nbytes, s.bucket_cap_bytes, options["first_bucket_bytes"])
    values = price[1](s.shapes, sizes, s.powersgd_rank)
    comms = [sum(comm_time(algorithm, FP32_BYTES * v, s.p, s.link, per_node=options["per_node"],
                           intra=options["intra"]) for v in bucket[:-1]) + bucket[-1] * s.powersgd_s_per_flop
             for bucket in values]
    wire = sum(sum(bucket[:-1]) for bucket in values)
    ratio = s.params / wire if wire else math.inf
    barriers = barrier_time(s.barrier_s, arm.mode, arm.width, s.buffers, s.p)
    if row.runs_at(arm.width) >= 2:  # DDP + pipelined(inner): Pipe-SGD width 2 over the buckets
        return (pipelined_time(s.compute_s, sum(comms), s.update_s, s.overlap_slowdown) + barriers) * 1e3, ratio
    iter_s = ddp_iteration_time(s.compute_s, sizes, comms, s.update_s, options["forward_fraction"],
                                s.overlap_slowdown)
    return (iter_s + barriers) * 1e3, ratio


REFERENCE = next(iter(ALL_ARMS))
"""The arm every speedup is against: the first, the uncompressed width-1 pipeline (sync, the
blocking fp32 ring)."""


def arm_rows(s: Scenario, arms: Sequence[str] = tuple(ARMS), table: Mapping[str, Arm] = ALL_ARMS) -> list[dict]:
    """One row per arm (names of ``table``, default :data:`ALL_ARMS`): arm, mode, width, compressor,
    algorithm (the faster one the arm may run), ratio (fp32 bytes / wire bytes), iter_ms,
    speedup_vs_sync (the :data:`REFERENCE` arm's step over this one's)."""
    unknown = [a for a in arms if a not in table]
    if unknown:
        raise ValueError(f"arms must be among {list(table)}, got {unknown}")
    rows = []
    for name in arms:
        arm = table[name]
        best = min(((*_arm_ms(s, arm, a), a) for a in s.algorithms), key=lambda t: t[0])
        rows.append({"arm": name, "mode": arm.mode, "width": arm.width, "compressor": arm.compressor,
                     "algorithm": best[2], "ratio": best[1], "iter_ms": best[0]})
    sync_ms = min(_arm_ms(s, ALL_ARMS[REFERENCE], a)[0] for a in s.algorithms)
    for row in rows:
        row["speedup_vs_sync"] = sync_ms / row["iter_ms"] if row["iter_ms"] else math.inf
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    """winner (fastest arm), best_pipe (the fastest pipelined arm: width >= 2), best_ddp (the
    fastest arm whose reductions overlap backward at width 1: DDP), and pipe_over_ddp = best DDP
    step / best pipe step (> 1: pipelining is faster); the last three None when ``rows`` have no
    arm of that kind."""
    def best(pipelined: bool) -> dict | None:
        def keep(r: dict) -> bool:
            return r["width"] >= 2 if pipelined else r["width"] == 1 and get_mode(r["mode"]).overlap == "backward"

        return min((r for r in rows if keep(r)), key=lambda r: r["iter_ms"], default=None)

    pipe, ddp = best(True), best(False)
    both = pipe is not None and ddp is not None
    return {"winner": min(rows, key=lambda r: r["iter_ms"])["arm"], "best_pipe": pipe and pipe["arm"],
            "best_ddp": ddp and ddp["arm"], "pipe_over_ddp": ddp["iter_ms"] / pipe["iter_ms"] if both else None}


def speedup_grid(params: int, compute_s: float, links: Sequence[Link], workers: Sequence[int], *,
                 backward_share: float = BACKWARD_SHARE, shapes: tuple[Shape, ...] | None = None,
                 **scenario) -> list[list[dict]]:
    """:func:`summarize` for every (link, p): ``grid[i][j]`` is ``links[i]`` at ``workers[j]``."""
    return [[summarize(arm_rows(Scenario(params, p, link, compute_s, backward_share, shapes=shapes, **scenario)))
             for p in workers] for link in links]


# --- rounds: the DiLoCo family at the smallest H that hides its exchange (docs/scale-map.md, "Rounds") ---
ROUND_FAMILIES: dict[str, tuple[str, int, str]] = {
    "diloco-pipelined-int8": ("pipe", PIPELINE_WIDTH, "int8"),  # the period-H pipeline: outer step in flight
    # the same on torchft's streaming schedule: fragments, each average landing τ steps late (sync_delay)
    "diloco-pipelined-int8-stream": ("pipe", PIPELINE_WIDTH, "int8"),
    "diloco-blocking-int8": ("sync", 1, "int8"),
    "torchft-diloco": ("torchft_diloco", 1, "none"),  # torchft 0.2.0's own (fp32: it quantizes with Triton only)
    "torchft-streaming": ("torchft_diloco", 1, "none"),  # its fragments, each launched τ steps early
}
"""The round arms the map prices, name -> (mode, width, compressor)."""
STREAMING = ("torchft-streaming", "diloco-pipelined-int8-stream")
"""The round families on torchft's streaming schedule (:func:`~pipesgd.timing.rounds.streaming_schedule`)."""
TORCHFT_MULTIPLES = (1, 2, 4)
"""torchft's arms and the streaming ones are priced at H, 2H and 4H: their best of three, not held to
the pipeline's H (a fragment must fit in τ < H/F steps, which H alone may not give)."""


def round_h(s: Scenario) -> int | None:
    """The smallest H (:data:`~pipesgd.timing.rounds.H_CANDIDATES`) whose int8 exchange of the whole
    model hides under a round's compute (:func:`~pipesgd.timing.rounds.smallest_h`); None if none."""
    ratio = compression_ratio("int8", s.params, chunks_for("ring", s.p))
    exchange = comm_time("ring", s.nbytes, s.p, s.link, ratio, s.compress_s_per_byte.get("int8", 0.0))
    return smallest_h(exchange, s.compute_s + s.update_s)


def round_rows(s: Scenario, h: int) -> list[dict]:
    """One row per round arm at ``h`` (torchft's also at 2h and 4h): arm (``<family>-h<H>``), family,
    mode, width, compressor, sync_every, fragments, sync_delay, iter_ms (per inner step) and
    utilization (compute and update over the step)."""
    rows = []
    for family, (mode, width, compressor) in ROUND_FAMILIES.items():
        for k in TORCHFT_MULTIPLES if mode == "torchft_diloco" or family in STREAMING else (1,):
            every = h * k
            fragments, delay = streaming_schedule(every) if family in STREAMING else (1, 0)
            if delay < 0 or (family != "torchft-streaming" and family in STREAMING and delay == 0):
                continue
            ratio = compression_ratio(compressor, s.params, chunks_for("ring", s.p))
            kappa = s.compress_s_per_byte.get(compressor, 0.0) if compressor != "none" else 0.0
            ms = round_iter_ms(mode, "ring", s.nbytes, s.p, s.link, s.compute_s, s.update_s, width, ratio, kappa,
                               sync_every=every, fragments=fragments, sync_delay=delay,
                               overlap_slowdown=s.overlap_slowdown)
            exchange = comm_time("ring", s.nbytes / fragments, s.p, s.link, ratio, kappa)
            rows.append({"arm": f"{family}-h{every}", "family": family, "mode": mode, "width": width,
                         "compressor": compressor, "sync_every": every, "fragments": fragments, "sync_delay": delay,
                         "iter_ms": ms, "utilization": (s.compute_s + s.update_s) * 1e3 / ms if ms else 1.0,
                         "hidden": hides(exchange, s.compute_s + s.update_s, every, width, fragments, delay)})
    return rows + replica_rows(s, h)


REPLICA_FAMILY = "diloco-pipelined-int8-replicas"
"""The period-H pipeline with each node one replica of ``per_node`` ranks (``dist.ranks_per_replica``)."""


def replica_rows(s: Scenario, h: int | None) -> list[dict]:
    """:data:`REPLICA_FAMILY`'s rows where the cluster has nodes (``per_node`` > 1 with ``intra``;
    none otherwise): each node one replica of ``per_node`` ranks, every inner step
    averaged on the node's fabric (``intra``), a round's int8 pseudo-gradient exchanged between the
    p / per_node nodes in per_node shards on ``link`` and gathered on ``intra``
    (:func:`~pipesgd.timing.rounds.replica_terms`); at ``h`` and at the smallest H that hides its
    own exchange (a node's link carries 1/per_node of what a replica of one rank sends); ``h`` None
    (no H hides the whole model's exchange of replicas of one rank): at its own H only, if one hides."""
    if s.per_node < 2 or s.intra is None:
        return []
    k, replicas = s.per_node, s.p // s.per_node
    ratio = compression_ratio("int8", s.params, chunks_for("ring", replicas))
    kappa = s.compress_s_per_byte.get("int8", 0.0)
    inner_step, gather = replica_terms(s.nbytes, k, s.intra)
    exchange = comm_time("ring", s.nbytes / k, replicas, s.link, ratio, kappa) + gather
    step = s.compute_s + s.update_s + inner_step
    rows = []
    for every in sorted({h, smallest_h(exchange, step)} - {None}):
        ms = round_iter_ms("pipe", "ring", s.nbytes, s.p, s.link, s.compute_s, s.update_s, PIPELINE_WIDTH, ratio,
                           kappa, sync_every=every, overlap_slowdown=s.overlap_slowdown, ranks_per_replica=k,
                           inner=s.intra)
        rows.append({"arm": f"{REPLICA_FAMILY}-h{every}", "family": REPLICA_FAMILY, "mode": "pipe",
                     "width": PIPELINE_WIDTH, "compressor": "int8", "sync_every": every, "fragments": 1,
                     "sync_delay": 0, "ranks_per_replica": k, "iter_ms": ms,
                     "utilization": (s.compute_s + s.update_s) * 1e3 / ms if ms else 1.0,
                     "hidden": hides(exchange, step, every, PIPELINE_WIDTH)})
    return rows


FAMILIES = {"DDP hook": "ddp", "Pipe-SGD": "pipe", "pipelined DiLoCo": "diloco-pipelined-int8",
            "torchft DiLoCo": "torchft"}
"""The families the map's verdict names, with how their arms' names begin."""


TIE = 0.02
"""Steps within this share of the fastest tie; the tie goes to the family that exchanges most often."""


def lateness(row: dict) -> int:
    """Inner steps between an exchange's launch and the step its average lands at, for a row of
    :func:`round_rows` or :func:`arm_rows`: a round (H) for a pipelined round without a delay, τ
    with one (``sync_delay``), none where the step waits (width 1); a per-step arm's width − 1."""
    width, every, delay = row.get("width", 1), row.get("sync_every", 1), row.get("sync_delay", 0)
    if every <= 1:
        return max(width - 1, 0)
    return delay if delay else (every if width >= 2 else 0)


def family_verdict(step_rows: Sequence[dict], rounds: Sequence[dict], h: int | None) -> dict:
    """Which family's fastest arm has the shortest step (the per-step arms and the round arms at
    ``h`` together): {family, arm, iter_ms, h (None for a per-step family), lateness}, and each
    family's best. Within a family, the arms within :data:`TIE` of its fastest tie, and of those the
    ones that hide their exchange with a margin (``hidden``,
    :func:`~pipesgd.timing.rounds.hides`) before those that only just fit, then the one whose
    average lands soonest after its launch (:func:`lateness`, then the shorter round): on the
    GPT recipe a fragment landing one step late ends 1 % over sync and one landing a round late 9 %
    (docs/period-h.md). Families within :data:`TIE` of the fastest tie, and the one with the
    shortest period wins (a per-step family before any with rounds, then :data:`FAMILIES`' order):
    where every family hides its exchange, a round costs loss per step for nothing. Per step only
    otherwise: a round arm's loss per step is its own, measured in docs/period-h.md."""
    members: dict[str, list[dict]] = {}
    for row in [*step_rows, *rounds]:
        family = next((f for f, start in FAMILIES.items() if row["arm"].startswith(start)), None)
        if family is not None and not (family == "Pipe-SGD" and row["width"] < 2):
            members.setdefault(family, []).append(row)
    best: dict[str, dict] = {}
    for family, rows in members.items():
        quickest = min(r["iter_ms"] for r in rows)
        row = min((r for r in rows if r["iter_ms"] <= quickest * (1 + TIE)),
                  key=lambda r: (not r.get("hidden", True), lateness(r), r.get("sync_every", 1), r["iter_ms"]))
        best[family] = {"arm": row["arm"], "iter_ms": row["iter_ms"], "h": row.get("sync_every"),
                        "lateness": lateness(row)}
    fastest = min((b["iter_ms"] for b in best.values()), default=None)
    tied = [f for f in FAMILIES if f in best and best[f]["iter_ms"] <= fastest * (1 + TIE)]
    winner = min(tied, key=lambda f: (best[f]["h"] or 1, best[f]["iter_ms"])) if tied else None
    return {"family": winner, **(best[winner] if winner else {}), "h_rule": h, "best": best}
