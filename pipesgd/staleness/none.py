"""``staleness=none``: the plain stale rule, bit for bit the core engine's update."""

from __future__ import annotations

from torch import Tensor

from .base import Staleness, register


@register("none")
class Plain(Staleness):
    """The plain stale rule: apply the average as it is (a gradient's, or a round's pseudo-gradient)."""

    sync_period = "any"

    def apply(self, avg: Tensor) -> None:
        self.step_optimizer(avg)
