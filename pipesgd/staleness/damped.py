"""``staleness=damped``: the outer step scaled by its staleness. Only for ``trainer.sync_every > 1``
(docs/period-h.md).

A round's average that lands s rounds after its launch steps the outer optimizer with

    Δ̄ / (1 + c · s)                      s = width - 1 (a whole round late per round in flight),
                                          or sync_delay / sync_every when it lands that many steps late

so a blocking round (s = 0) is the plain rule, and a late one is taken with a lower outer learning
rate, the remedy the eager-updates paper measures for a one-round delay (Kale, Douillard and
Donchev, 2025: +12.7 % naive, +2.2 % with the outer rate lowered); CO2 (Sun et al., 2024) likewise
shrinks the late outer step. With SGD (the outer optimizers here) scaling the pseudo-gradient by a
constant is scaling the outer learning rate by it, momentum included. ``c`` is
``trainer.outer_damping`` (default 1: a round late halves the outer rate). The engine that binds
the rule sets ``lateness`` = s. Replicas stay identical (every one applies the same average).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Staleness, register


@register("damped")
class Damped(Staleness):
    """The late average scaled by 1 / (1 + outer_damping · lateness) (the module docstring)."""

    sync_period = "round"
    options = ("outer_damping",)
    optimizers = (torch.optim.SGD,)

    def __init__(self, outer_damping: float = 1.0) -> None:
        if isinstance(outer_damping, bool) or not isinstance(outer_damping, (int, float)) or outer_damping < 0:
            raise ValueError(f"trainer.outer_damping must be a number >= 0 (0: the plain rule), got {outer_damping!r}")
        self.outer_damping = float(outer_damping)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 + self.outer_damping * self.lateness)

    def apply(self, avg: Tensor) -> None:
        self.step_optimizer(avg.mul_(self.scale))
