"""The outer step's defaults at ``trainer.sync_every = H > 1``: SGD on the averaged pseudo-gradient
with a rate and a momentum that follow H and the number of replicas M (docs/period-h.md, "Outer
settings that follow H and M").

The DiLoCo papers' outer step (Nesterov, lr 0.7, momentum 0.9) was tuned at H = 500 on models of a
billion parameters; on the GPT recipe it ties synchronous training at H = 10 and costs over 12 % at
H = 5, whatever its rate, because the momentum carries a direction for ten rounds and rounds of
five steps point the same way for most of them. So the momentum follows H: none at H <= 5 (the
replicas' average move, local SGD's model averaging), the papers' 0.9 from H = 10, and in between
linear in log H. The rate follows the momentum. :data:`MEASURED` holds the points the sweep chose
(``python -m pipesgd_lab.bench.outer_sweep``, records in results/outer-sweep); :func:`settings`
interpolates between them and holds the nearest outside. Where a round lands late and is mixed with
the local weights, their share follows M (:func:`landing_alpha`). Standard library only
(:func:`factory` imports torch when called).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

MEASURED = ((5, 1.0, 0.0), (10, 0.7, 0.9))
"""(H, outer lr, Nesterov momentum) the sweep chose at M = 2 replicas, by H."""


@dataclass(frozen=True)
class OuterSettings:
    """One outer step: SGD with this rate and momentum (Nesterov's when ``nesterov``)."""

    lr: float
    momentum: float
    nesterov: bool

    def as_dict(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}


def settings(sync_every: int, replicas: int = 2) -> OuterSettings:
    """The default outer step for rounds of ``sync_every`` inner steps over ``replicas`` replicas."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r} is invalid: must be an integer >= 1 (inner steps per round)")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} is invalid: must be an integer >= 1")
    h = math.log(sync_every)
    points = [(math.log(p), lr, m) for p, lr, m in MEASURED]
    if h <= points[0][0]:
        _, lr, momentum = points[0]
    elif h >= points[-1][0]:
        _, lr, momentum = points[-1]
    else:
        (h0, lr0, m0), (h1, lr1, m1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= h <= b[0])
        w = (h - h0) / (h1 - h0)
        lr, momentum = lr0 + w * (lr1 - lr0), m0 + w * (m1 - m0)
    return OuterSettings(lr=round(lr, 4), momentum=round(momentum, 4), nesterov=momentum > 0)


LANDING_REPLICAS = (4, 8)
"""The numbers of replicas between which :func:`landing_alpha` is 1 / M (held beyond)."""


def landing_alpha(replicas: int) -> float:
    """The local weights' share where a round lands late (``landing_alpha="auto"``): 1 / M for M
    in :data:`LANDING_REPLICAS`, a quarter below (M = 2 included), an eighth above. At a fixed
    global batch each replica's steps see 1 / M of it, so the weights it trained since the last
    landing are the noisier the more replicas share the batch; the mix θ ← α·θ + (1 − α)·anchor
    keeps α of them. The sweep (docs/period-h.md, "The landing's share follows M"; one epoch of the
    GPT recipe at H = 10, one step late) found the best α at 0.25 for M = 2 and 4 and 0.125 for
    M = 8, where streaming DiLoCo's 0.5 ended 1.1 %, 2.1 % and 4.2 % higher."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} is invalid: must be an integer >= 1")
    low, high = LANDING_REPLICAS
    return 1.0 / min(max(replicas, low), high)


def fill(given: dict, sync_every: int, replicas: int) -> dict:
    """``given`` (an outer optimizer's keyword arguments, e.g. the ``outer_optimizer`` config
    group's) with every ``None`` among lr, momentum and nesterov taken from :func:`settings`."""
    pick = settings(sync_every, replicas).as_dict()
    out = {**given, **{k: pick[k] for k in ("lr", "momentum") if given.get(k) is None}}
    if given.get("nesterov") is None:  # Nesterov's wherever there is a momentum (torch refuses it at 0)
        out["nesterov"] = out["momentum"] > 0
    return out


def factory(sync_every: int, replicas: int = 2) -> Callable:
    """The default outer optimizer for this H and M: a callable building SGD over the anchor tensors."""
    import torch

    return functools.partial(torch.optim.SGD, **settings(sync_every, replicas).as_dict())


def describe(optimizer) -> dict:
    """What an outer optimizer steps with: its kind and its first group's rate and momentum."""
    group = optimizer.param_groups[0]
    return {"optimizer": type(optimizer).__name__, "lr": group.get("lr"), "momentum": group.get("momentum"),
            "nesterov": group.get("nesterov")}
