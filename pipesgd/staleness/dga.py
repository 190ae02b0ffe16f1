"""``staleness=dga``: delayed gradient averaging (Zhu et al., NeurIPS 2021)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor

from ..flat import add_to_params, assign_params, flat_params, has_nonfinite, views
from .base import Staleness, register



@register("dga")
class DelayedAveraging(Staleness):
    """Each rank adds its own step ``δ_t = -η_t·g_t^local`` at once and, when the average of step t
    arrives, removes ``δ_t`` and lets the optimizer apply the average:

        w_t^i = w̄_t + Σ_{pending j} δ_j,    w̄_{t+1} = optimizer step of w̄_t with ḡ_{t-D}.

    w̄ (kept as an exact copy) is what every replica agrees on: the optimizer's whole state
    (momentum, weight decay, lr schedule) is driven by averages only, at the consistent weights.
    The local term is a plain SGD step with the parameter group's lr, no momentum, no weight
    decay. For plain SGD (no momentum, no weight decay) and D = 1 this is exactly DGA's
    ``w_{t+1} = w_t - η(g_t^local - g_{t-1}^local + ḡ_{t-1})``. With D = 0 it is the plain rule bit
    for bit. Replicas differ by their pending local steps; :meth:`consistent_params` and
    :meth:`consistent_weights` give w̄.

    Cost: per launch one scaled gradient copy; per update two parameter-sized copies and D adds.
    Memory: w̄ and the D+1 pending local steps.
    """

    # The local term -lr·g is SGD's step; Adam's own step on g has another direction and scale
    # (g / sqrt(v)), so -lr·g would be a wrong local update: refused (check_optimizer).
    optimizers = (torch.optim.SGD,)

    def __init__(self) -> None:
        self._local: deque[Tensor] = deque()
        self._base: Tensor | None = None  # w̄ while local steps are applied, else None

    def bind(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> None:
        super().bind(params, optimizer)
        slot = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in slot]
        if missing:
            raise ValueError(f"staleness=dga: parameters {missing} are not in the optimizer")
        self._lr_slot = [slot[id(p)] for p in self.params]

    def launched(self, local: Tensor) -> None:
        groups = self.optimizer.param_groups
        step = torch.empty_like(local)
        for i, g, s in zip(self._lr_slot, views(self.params, local), views(self.params, step)):
            torch.mul(g, -groups[i]["lr"], out=s)
        # A NaN/inf local step would poison this replica's weights and every later gradient, not
        # just the step trainer.nonfinite drops: take none (one cheap sum, no device sync).
        step.masked_fill_(has_nonfinite(local), 0.0)
        if self._base is None:
            self._base = flat_params(self.params)
        add_to_params(self.params, step)
        self._local.append(step)

    def skip(self) -> None:
        """Take back the dropped step's local update: back to w̄ plus the other pending steps."""
        self._local.popleft()
        assign_params(self.params, self._base)
        self._reapply_local()

    def apply(self, avg: Tensor) -> None:
        self._local.popleft()
        assign_params(self.params, self._base)
        self.step_optimizer(avg)
        self._reapply_local()

    def _reapply_local(self) -> None:
        if self._local:
            self._base = flat_params(self.params)
            for step in self._local:
                add_to_params(self.params, step)
        else:
            self._base = None

    def consistent_params(self) -> Tensor:
        return flat_params(self.params) if self._base is None else self._base.clone()

    @contextmanager
    def _consistent(self) -> Iterator[None]:
        saved = flat_params(self.params)
        assign_params(self.params, self._base)
        try:
            yield
        finally:
            assign_params(self.params, saved)

    def consistent_weights(self) -> AbstractContextManager:
        return nullcontext() if self._base is None else self._consistent()

    def state_dict(self) -> dict:
        state = {"local": [s.clone() for s in self._local]}
        if self._base is not None:
            state["base"] = self._base.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._local = deque(self._check_numel("local step", s) for s in state.get("local", []))
        base = state.get("base")
        self._base = None if base is None else self._check_numel("base", base)
