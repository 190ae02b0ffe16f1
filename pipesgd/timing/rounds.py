"""Rounds: what a step costs when the exchange comes once every H inner steps (DiLoCo's family,
``trainer.sync_every=H``), and which H a link needs (docs/timing-model.md, "Rounds").

A round is H steps of compute and one exchange of the pseudo-gradient, carried in F fragments of
1/F of the model each (F = 1: the whole model at once). Its exchange x_f is one fragment's
allreduce, priced by :func:`~pipesgd.timing.model.comm_time` as any gradient's is. Per inner step:

    pipelined, width K >= 2    max(H·c' + H·u, F·x_f) / H       (pipe at sync_every = H: the round's
                                                                  exchanges run on one thread under
                                                                  the next round's compute)
    width 1, delay τ           ((P − τ)·c + max(τ·c', x_f) + P·u) / P,   P = H/F
                               (sync at sync_every = H: τ = 0, each fragment's exchange blocks at its
                                round's end; torchft_diloco: each is launched τ steps before it is
                                waited for, the streaming paper's overlap; pipe at width 2 with
                                sync_delay τ > 0: the same, its average landing τ steps late)

c' is compute stretched by the overlap slowdown while an exchange runs beside it. At F = 1 and
τ = 0 these are :func:`~pipesgd.timing.model.predict_iter_ms` at ``sync_every=H``.

Replicas of k ranks (``dist.ranks_per_replica``; :func:`replica_terms`): the p workers are M = p/k
replicas; every inner step adds the replica's blocking allreduce of the gradient over its k ranks on
the inner link (c becomes c + a_k), and a fragment's exchange is its 1/k shard summed over the M
rank peers on the outer link plus the gather of the k summed shards on the inner link. The smallest H
that hides the exchange is :func:`smallest_h`: what the period-H study runs on each link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import period
from ..modes import get_mode
from .model import Link, _overlapped, comm_time

H_CANDIDATES = (2, 5, 10, 25, 50, 100)
"""The round lengths the study and the map pick from (:func:`smallest_h`)."""
FILL = 0.9
"""The share of a round's compute an exchange may take and still count as hidden: the rest is
margin for the jitter of the steps and the exchange (a round that fits exactly has none)."""


def _check(name: str, value: float, low: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low:g}, got {value!r}")


def check_schedule(sync_every: int, fragments: int = 1, sync_delay: int = 0, prefix: str = "",
                   width: int | None = None) -> None:
    """ValueError naming every setting (``prefix`` + its name, e.g. ``trainer.``) where ``(H, F, τ)`` is
    not a schedule at ``width`` (:func:`pipesgd.period.problems`; below 2 or None: torchft's schedule)."""
    torchft = width is None or width < 2
    period.check(sync_every, fragments, sync_delay, width=None if torchft else width, prefix=prefix,
                 runs=f"got width {width} (or 1: torchft's schedule)")


def round_step_s(fragment_exchange_s: float, compute_s: float, update_s: float, sync_every: int, width: int = 1,
                 fragments: int = 1, sync_delay: int = 0, overlap_slowdown: float = 1.0) -> float:
    """Seconds per inner step of a round (module docstring): ``fragment_exchange_s`` is one
    fragment's allreduce (the whole model's at ``fragments=1``)."""
    check_schedule(sync_every, fragments, sync_delay, width=width)
    for name, value in (("fragment_exchange_s", fragment_exchange_s), ("compute_s", compute_s),
                        ("update_s", update_s)):
        _check(name, value)
    _check("overlap_slowdown", overlap_slowdown, 1.0)
    h, exchanges = sync_every, fragments * fragment_exchange_s
    if width >= 2 and not sync_delay:
        return max(_overlapped(h * compute_s, exchanges, overlap_slowdown) + h * update_s, exchanges) / h
    period, delay, x = h // fragments, sync_delay, fragment_exchange_s
    beside = max(_overlapped(delay * compute_s, x, overlap_slowdown), x)  # the τ steps launched beside it, or it
    return ((period - delay) * compute_s + beside + period * update_s) / period


def hides(fragment_exchange_s: float, compute_s: float, sync_every: int, width: int = 1, fragments: int = 1,
          sync_delay: int = 0, fill: float = FILL) -> bool:
    """Whether a round's exchanges hide under compute with ``fill`` of it to spare for the steps'
    jitter: pipelined (width >= 2, no delay), the F fragments' exchanges within ``fill`` of the
    round's compute; landing τ steps after the launch (``sync_delay``), one fragment's within
    ``fill`` of τ steps; a blocking round (width 1, no delay) never hides. A schedule that fits
    with no margin is not hidden: each landing waits for the slower replica, and the jitter of τ
    steps is what a fragment has to spare (docs/period-h.md measures it)."""
    check_schedule(sync_every, fragments, sync_delay)
    _check("fragment_exchange_s", fragment_exchange_s)
    _check("compute_s", compute_s)
    if not 0 < fill <= 1:
        raise ValueError(f"fill must be in (0, 1], got {fill!r}")
    if sync_delay:
        return fragment_exchange_s <= fill * sync_delay * compute_s
    return width >= 2 and fragments * fragment_exchange_s <= fill * sync_every * compute_s


def replica_terms(nbytes: float, ranks_per_replica: int, inner: Link) -> tuple[float, float]:
    """(seconds of a replica's inner allreduce of ``nbytes`` a step, seconds of gathering a round's
    ``nbytes`` from its k summed shards) on the replica's ``inner`` link: the backend's allreduce
    priced as the ring, and an allgather's k − 1 steps of one shard each; (0, 0) at k = 1."""
    k = ranks_per_replica
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"ranks_per_replica must be an integer >= 1, got {k!r}")
    if k == 1:
        return 0.0, 0.0
    return comm_time("native", nbytes, k, inner), (k - 1) * (inner.alpha + nbytes / k * inner.beta)


def round_iter_ms(mode: str, algorithm: str, nbytes: float, p: int, link: Link, compute_s: float,
                  update_s: float = 0.0, width: int = 1, ratio: float = 1.0, compress_s_per_byte: float = 0.0, *,
                  sync_every: int, fragments: int = 1, sync_delay: int = 0, overlap_slowdown: float = 1.0,
                  ranks_per_replica: int = 1, inner: Link | None = None, **comm_options) -> float:
    """Predicted milliseconds per inner step of ``mode`` at ``sync_every=H``: each of its F
    fragments (1/F of ``nbytes``) exchanged over ``algorithm`` at ``ratio``, priced by
    :func:`round_step_s` at the width the mode runs (``comm_options``: :func:`comm_time`'s).
    ``ranks_per_replica`` = k > 1: the p workers as p/k replicas of k ranks on ``inner`` (default
    ``link``), the terms of :func:`replica_terms` added (module docstring)."""
    width = get_mode(mode).runs_at(width)
    options = {k: v for k, v in comm_options.items() if k in ("per_node", "intra", "server_on_worker")}
    k = ranks_per_replica
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or p % k:
        raise ValueError(f"ranks_per_replica={k!r} must be an integer >= 1 that divides p={p}")
    inner_step = replica_terms(nbytes, k, inner or link)[0]  # every step: the whole gradient
    gather = replica_terms(nbytes / fragments, k, inner or link)[1]  # every exchange: one fragment
    exchange = comm_time(algorithm, nbytes / fragments / k, p // k, link, ratio, compress_s_per_byte, **options)
    return 1e3 * round_step_s(exchange + gather, compute_s + inner_step, update_s, sync_every, width, fragments,
                              sync_delay, overlap_slowdown)


def smallest_h(exchange_s: float, compute_s: float, candidates: Sequence[int] = H_CANDIDATES,
               fill: float = FILL) -> int | None:
    """The smallest H of ``candidates`` at which the pipeline (width 2, the whole model) hides the
    exchange under the round's compute, H·``compute_s``, with ``fill`` of it (:func:`hides`:
    exchange <= fill·H·compute); None if none does. The pipeline's point: the smallest H keeps the
    loss closest to synchronous training's."""
    _check("exchange_s", exchange_s)  # named as the caller passed it, before any candidate
    return next((h for h in sorted(candidates) if hides(exchange_s, compute_s, h, width=2, fill=fill)), None)


def streaming_schedule(sync_every: int) -> tuple[int, int]:
    """(fragments, delay) of torchft's streaming DiLoCo as the study runs it at ``sync_every``: five
    fragments where five divide H (two otherwise), and torchft's ``fragment_sync_delay`` as long as
    its rule allows (one step short of a fragment's period), the most compute to hide under."""
    fragments = 5 if sync_every % 5 == 0 else 2 if sync_every % 2 == 0 else 1
    return fragments, sync_every // fragments - 1
