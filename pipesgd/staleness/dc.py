"""``staleness=dc``: DC-ASGD's first-order delay compensation (Zheng et al., ICML 2017)."""

from __future__ import annotations

from collections import deque

from torch import Tensor

from ..flat import flat_params
from .base import Staleness, register


@register("dc")
class DelayCompensation(Staleness):
    """``g <- g + λ_t ⊙ g ⊙ g ⊙ (w_now - w_then)``: a first-order Taylor correction of the gradient
    from the weights it was computed at (``w_then``) to the weights it is applied to, with
    ``g⊙g`` as the diagonal Hessian approximation. ``dc_adaptive``: ``λ_t = λ / sqrt(ms_t + 1e-12)``
    with ``ms_t = m·ms_{t-1} + (1-m)·g⊙g`` elementwise (DC-ASGD-a), else ``λ_t = λ`` (DC-ASGD-c).

    Cost: a flat snapshot of the weights at every launch (K-1 kept, one parameter-sized copy per
    step on the caller's thread) and four elementwise passes per update.
    """

    options = ("dc_lambda", "dc_adaptive", "dc_momentum")

    def __init__(self, dc_lambda: float = 0.04, dc_adaptive: bool = False, dc_momentum: float = 0.95):
        if isinstance(dc_lambda, bool) or not isinstance(dc_lambda, (int, float)) or dc_lambda < 0:
            raise ValueError(f"staleness.dc_lambda={dc_lambda!r} is invalid: must be a number >= 0")
        if not 0 <= dc_momentum < 1:
            raise ValueError(f"staleness.dc_momentum={dc_momentum!r} is invalid: must be in [0, 1)")
        self.dc_lambda, self.adaptive, self.momentum = float(dc_lambda), bool(dc_adaptive), float(dc_momentum)
        self._then: deque[Tensor] = deque()
        self._mean_square: Tensor | None = None

    def launched(self, local: Tensor) -> None:
        self._then.append(flat_params(self.params))

    def skip(self) -> None:
        self._then.popleft()

    def apply(self, avg: Tensor) -> None:
        w_then = self._then.popleft()
        square = avg * avg
        if self.adaptive:
            if self._mean_square is None:
                self._mean_square = square.clone()
            else:
                self._mean_square.mul_(self.momentum).add_(square, alpha=1 - self.momentum)
            square.div_(self._mean_square.add(1e-12).sqrt_())
        w_now = flat_params(self.params)
        avg.addcmul_(square, w_now.sub_(w_then), value=self.dc_lambda)
        self.step_optimizer(avg)

    def state_dict(self) -> dict:
        state = {"w_then": [w.clone() for w in self._then]}
        if self._mean_square is not None:
            state["mean_square"] = self._mean_square.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._then = deque(self._check_numel("w_then", w) for w in state.get("w_then", []))
        ms = state.get("mean_square")
        self._mean_square = None if ms is None else self._check_numel("mean_square", ms)
