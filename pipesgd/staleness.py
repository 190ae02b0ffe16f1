"""Staleness handling: how a late averaged gradient becomes a weight update.

The engine decides WHEN the average of step t-D is applied (D = the number of updates between a
gradient's computation and its application: K-1 in a full width-K pipeline, 0 while synchronous);
a :class:`Staleness` strategy decides WHAT that update is. ``trainer.staleness`` selects one:

- ``none``: ``optimizer.step()`` with ``p.grad`` = the average, the plain stale rule (bit for bit
  the core engine's update).
- ``dc``: DC-ASGD's first-order delay compensation (Zheng et al., ICML 2017):
  ``g <- g + λ·g⊙g⊙(w_now - w_then)``.
- ``predict``: weight prediction (SAPipe, Chen et al., NeurIPS 2022; SpecTrain, Chen et al. 2018):
  the gradient is computed at ``w + D·(w - w_prev)``, the weights extrapolated D updates ahead.
- ``dga``: delayed gradient averaging (Zhu et al., NeurIPS 2021): a rank applies its own
  gradient at once and swaps it for the average when that arrives.
- ``lookahead``: the gradient is computed at the weights the optimizer will reach once the
  in-flight steps are applied, with this rank's own gradients standing in for their averages
  (the optimizer itself takes the steps, momentum included, on a copy that is then discarded).

docs/convergence.md gives each rule, its cost and how it meets momentum. Every strategy is
bound to one engine's parameters and optimizer; methods run on the caller's thread.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import ClassVar

import torch
from torch import Tensor

from .flat import add_to_params, assign_params, flat_params, has_nonfinite, set_grads, views
from .registry import Registry

log = logging.getLogger(__name__)

_REGISTRY: Registry[type[Staleness]] = Registry("staleness")


class Staleness(ABC):
    """One engine's update rule for averaged gradients that arrive late.

    Call order, per engine step: ``launched(local)`` with this rank's flat gradient just before
    its reduction starts, then zero or more ``apply(avg)`` with averages in launch order; an
    average that is non-finite on some rank is replaced by ``skip()`` on every rank.
    ``options`` names the ``trainer.<key>`` settings the constructor takes.
    """

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()

    def bind(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.numel = sum(p.numel() for p in self.params)

    def launched(self, local: Tensor) -> None:
        """This rank's gradient of the step being launched. The reduction will overwrite
        ``local`` in place, so a strategy that needs it later must copy it now."""

    def skip(self) -> None:
        """The oldest launched step's average is dropped (trainer.nonfinite=skip): forget what
        ``launched`` kept for it, as if that step had never run."""

    @abstractmethod
    def apply(self, avg: Tensor) -> None:
        """Update the parameters with the average of the oldest launched step (``avg`` may be
        modified and is left as the parameters' ``.grad`` views)."""

    def step_optimizer(self, grad: Tensor) -> None:
        """The plain rule: ``optimizer.step()`` with every ``p.grad`` a view into ``grad``."""
        set_grads(self.params, grad)
        self.optimizer.step()

    def forward_context(self, delay: int) -> AbstractContextManager:
        """Weights the next forward/backward should see; ``delay`` = updates before its gradient
        is applied. Default: the current weights."""
        return nullcontext()

    def consistent_params(self) -> Tensor:
        """A flat copy of the weights every replica agrees on, bit for bit."""
        return flat_params(self.params)

    def consistent_weights(self) -> AbstractContextManager:
        """Inside: the parameters hold :meth:`consistent_params` (for evaluation); restored after."""
        return nullcontext()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def _check_numel(self, what: str, t: Tensor) -> Tensor:
        if t.numel() != self.numel:
            raise ValueError(f"{self.name}: checkpoint {what} has {t.numel()} values, model has {self.numel}")
        return t.clone()


def register(name: str):
    return _REGISTRY.register(name)


def available() -> list[str]:
    return list(_REGISTRY)


def make_staleness(name: str | Staleness = "none", **options) -> Staleness:
    """The strategy called ``name``, built from the ``options`` it takes (others are ignored, so
    the caller may pass every ``trainer.*`` staleness setting)."""
    if isinstance(name, Staleness):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"trainer.staleness={name!r} is not known; allowed: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    return cls(**{k: v for k, v in options.items() if k in cls.options})


@register("none")
class Plain(Staleness):
    """The plain stale rule: apply the average as it is."""

    def apply(self, avg: Tensor) -> None:
        self.step_optimizer(avg)


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
            raise ValueError(f"trainer.dc_lambda={dc_lambda!r} is invalid: must be a number >= 0")
        if not 0 <= dc_momentum < 1:
            raise ValueError(f"trainer.dc_momentum={dc_momentum!r} is invalid: must be in [0, 1)")
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


@register("predict")
class WeightPrediction(Staleness):
    """Forward/backward at ``w + D·d``, where ``d`` is the last applied update (``w_t - w_{t-1}``)
    and D the gradient's delay; the update is then applied to ``w`` itself. For SGD with momentum
    and a constant lr, ``d = -η·v`` and this is SpecTrain's ``w - D·η·v``; for any other optimizer it
    is the same linear extrapolation. D = 0 (synchronous steps, pipeline fill) uses ``w``.

    Cost: per update one weight snapshot and a subtraction (to know ``d``); per forward a snapshot
    and an add, and the exact restore on exit. Memory: two parameter-sized buffers.
    """

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

    def __init__(self) -> None:
        self._local: deque[Tensor] = deque()
        self._base: Tensor | None = None  # w̄ while local steps are applied, else None

    def bind(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> None:
        super().bind(params, optimizer)
        if not isinstance(optimizer, torch.optim.SGD):
            log.warning("trainer.staleness=dga takes plain SGD local steps (-lr * g); with %s their scale "
                        "differs from the optimizer's own steps", type(optimizer).__name__)
        slot = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in slot]
        if missing:
            raise ValueError(f"trainer.staleness=dga: parameters {missing} are not in the optimizer")
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


@register("lookahead")
class LocalLookahead(Staleness):
    """Forward/backward at ``ŵ = S(…S(w, g_{t-D}^local)…, g_{t-1}^local)``: the optimizer's own step
    ``S`` (momentum, weight decay, lr, LARS trust ratio: whatever ``optimizer.step()`` does) taken
    on each in-flight gradient in launch order, with this rank's gradient standing in for the
    average that has not arrived. The weights and the optimizer state are restored exactly on
    exit and the averages are applied as in ``none``, so replicas stay bit-identical.

    The true weights that the gradient will be applied to are ``S(…S(w, ḡ_{t-D})…, ḡ_{t-1})``, so
    ``ŵ`` misses them only by the steps' local-minus-average noise; with one rank (or identical
    data on every rank) ``ŵ`` is them, and the width-K run is synchronous SGD shifted by K-1
    steps, bit for bit. This is where it differs from ``predict``, which extrapolates the last
    applied update (one step older) and from ``dga``, whose local step has no momentum: at
    momentum μ the next update is mostly ``μ·v``, which both of those miss.

    Cost: per launch one gradient copy; per forward D optimizer steps, one weight snapshot and a
    copy of the optimizer's state for these parameters, restored on exit. Memory: D gradients,
    one weight copy and one optimizer-state copy. Optimizer step hooks run on the lookahead steps
    too. A non-finite local gradient contributes no lookahead step. The kept gradients are handed
    to ``optimizer.step()`` as they are (torch's optimizers and LARS only read ``p.grad``); an
    optimizer that writes into its gradient would only skew later lookaheads at K >= 3, never
    the applied update.
    """

    def __init__(self) -> None:
        self._local: deque[Tensor] = deque()

    def launched(self, local: Tensor) -> None:
        # NaN/inf here would poison the next forward; the update itself is the policy's business.
        self._local.append(local.clone().masked_fill_(has_nonfinite(local), 0.0))

    def skip(self) -> None:
        self._local.popleft()

    def apply(self, avg: Tensor) -> None:
        self._local.popleft()
        self.step_optimizer(avg)

    def forward_context(self, delay: int) -> AbstractContextManager:
        if delay == 0 or not self._local:
            return nullcontext()
        return self._ahead()

    @contextmanager
    def _ahead(self) -> Iterator[None]:
        weights = flat_params(self.params)
        state = self.optimizer.state
        saved = {p: _copy_state(state[p]) if p in state else None for p in self.params}
        grads = [p.grad for p in self.params]
        try:
            for local in self._local:
                self.step_optimizer(local)
        finally:
            for p, g in zip(self.params, grads):
                p.grad = g
        try:
            yield
        finally:
            assign_params(self.params, weights)
            for p, s in saved.items():
                if s is None:
                    state.pop(p, None)
                else:
                    state[p] = s

    def state_dict(self) -> dict:
        return {"local": [g.clone() for g in self._local]}

    def load_state_dict(self, state: dict) -> None:
        self._local = deque(self._check_numel("local gradient", g) for g in state.get("local", []))


def _copy_state(state: dict) -> dict:
    """A copy of one parameter's optimizer state: tensors cloned (7x cheaper than deepcopy on
    ResNet-20's 65 parameters: 0.19 against 1.37 ms), anything else deep-copied."""
    return {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}
