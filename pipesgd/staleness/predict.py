"""``staleness=predict``: weight prediction (SAPipe, Chen et al., NeurIPS 2022; SpecTrain, 2018)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch import Tensor

from ..flat import add_to_params, assign_params, flat_params
from .base import Staleness, register


@register("predict")
class WeightPrediction(Staleness):
    """Forward/backward at ``w + D·d``, where ``d`` is the last applied update (``w_t - w_{t-1}``)
    and D the gradient's delay; the update is then applied to ``w`` itself. For SGD with momentum
    and a constant lr, ``d = -η·v`` and this is SpecTrain's ``w - D·η·v``; for any other optimizer it
    is the same linear extrapolation. D = 0 (synchronous steps, pipeline fill) uses ``w``.

    Cost: per update one weight snapshot and a subtraction (to know ``d``); per forward a snapshot
    and an add, and the exact restore on exit. Memory: two parameter-sized buffers.
    """

    uses_forward_context = True

    def __init__(self) -> None:
        self._delta: Tensor | None = None

    def apply(self, avg: Tensor) -> None:
        before = flat_params(self.params)
        self.step_optimizer(avg)
        self._delta = flat_params(self.params).sub_(before)

    @contextmanager
    def _predicted(self, delay: int) -> Iterator[None]:
        saved = flat_params(self.params)
        add_to_params(self.params, self._delta, alpha=float(delay))
        try:
            yield
        finally:
            assign_params(self.params, saved)

    def forward_context(self, delay: int) -> AbstractContextManager:
        if delay == 0 or self._delta is None:
            return nullcontext()
        return self._predicted(delay)

    def state_dict(self) -> dict:
        return {} if self._delta is None else {"delta": self._delta.clone()}

    def load_state_dict(self, state: dict) -> None:
        delta = state.get("delta")
        self._delta = None if delta is None else self._check_numel("delta", delta)
