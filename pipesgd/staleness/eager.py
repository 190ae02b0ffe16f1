"""``staleness=eager``: the outer step of the period-H pipeline with this replica's own fresh
pseudo-gradient standing in for its share of the average still in flight ("eager updates", Kale,
Douillard and Donchev, 2025). Only for ``trainer.sync_every > 1`` at width 2 (one outer step in
flight); docs/period-h.md gives the equations and what each replica applies.

At the end of round t a replica m holds its own pseudo-gradient Δ_t^m (just launched) and the
average Δ̄_{t-1} of the round before (just arrived). The naive delayed rule (``none``) steps the
outer optimizer with Δ̄_{t-1}; eager steps it with

    Δ̃_t^m = Δ̄_{t-1} + (Δ_t^m - Δ_{t-1}^m) / M      (M replicas)

i.e. the others' part of the late average, (1/M) Σ_{m'≠m} Δ_{t-1}^{m'}, plus its own part of the
average not yet arrived, Δ_t^m / M. Over the run the own terms telescope: with a plain SGD outer
step the anchor after round t is the delayed rule's plus this replica's freshest Δ_t^m / M, and
:meth:`PipeDiLoCo.flush` (the last average, with no fresher round) removes it. Replicas therefore
differ by their own fresh term between outer steps (through the outer optimizer's momentum, also
after), which is why this rule declares its replicas do not agree (``PipeDiLoCo.replicas_agree``).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from ..flat import has_nonfinite
from .base import Staleness, register


@register("eager")
class Eager(Staleness):
    """The eager outer rule. ``replicas`` (M) is set by the engine that binds it (its group's size)."""

    sync_period = "round"
    agrees = False
    replicas: int = 1

    def __init__(self) -> None:
        self._own: deque[Tensor] = deque()  # this replica's pseudo-gradients launched and not yet applied

    def launched(self, local: Tensor) -> None:
        # A non-finite own contribution never reaches the anchor: its round is dropped on every
        # rank when the average lands (trainer.nonfinite), and here it counts as zero meanwhile.
        own = local.clone()
        if has_nonfinite(own):
            own.zero_()
        self._own.append(own)

    def filled(self) -> None:
        """Nothing arrived yet (round 1): the eager step with a zero late average, Δ_1^m / M."""
        self._eager(torch.zeros_like(self._own[-1]), None)

    def apply(self, avg: Tensor) -> None:
        self._eager(avg, self._own.popleft())

    def skip(self) -> None:
        """The oldest round's average is dropped on every rank: it counts as a zero average, so the
        own term it had added is removed and the freshest one added, as at an applied round."""
        prev = self._own.popleft()
        self._eager(torch.zeros_like(prev), prev)

    def _eager(self, late: Tensor, prev: Tensor | None) -> None:
        """Step the outer optimizer with ``late`` - prev / M + fresh / M (fresh: the newest launched
        round's own pseudo-gradient, none at the final flush)."""
        inv = 1.0 / self.replicas
        if prev is not None:
            late.sub_(prev, alpha=inv)
        if self._own:
            late.add_(self._own[-1], alpha=inv)
        self.step_optimizer(late)

    def state_dict(self) -> dict:
        return {"own": [t.clone() for t in self._own]}

    def load_state_dict(self, state: dict) -> None:
        self._own = deque(self._check_numel("own pseudo-gradient", t) for t in state.get("own", []))
