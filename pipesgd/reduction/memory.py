"""Error feedback as explicit state (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, EF-SGD).

What a lossy reduction drops this step is added to the next step's input, so nothing is lost,
only delayed. The invariant the tests check: after ``update(corrected, decoded)``,
``corrected == decoded + residual`` (up to one rounding of the subtraction).
"""

from __future__ import annotations

from torch import Tensor


class ErrorFeedback:
    """The residual memory of one rank: ``add_to(grad)`` -> ``corrected``; compress; ``update``."""

    def __init__(self) -> None:
        self.residual: Tensor | None = None

    def add_to(self, grad: Tensor) -> Tensor:
        """``grad += residual`` in place (the first step has none); returns ``grad``."""
        if self.residual is not None:
            grad.add_(self.residual)
        return grad

    def update(self, corrected: Tensor, decoded: Tensor) -> None:
        """Remember what compression dropped from ``corrected``. Costs one tensor of memory."""
        self.residual = corrected - decoded

    def state_dict(self) -> dict:
        return {} if self.residual is None else {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict, numel: int) -> None:
        residual = state.get("residual")
        if residual is not None and residual.numel() != numel:
            raise ValueError(f"error-feedback residual has {residual.numel()} values, model has {numel}")
        self.residual = None if residual is None else residual.clone()
