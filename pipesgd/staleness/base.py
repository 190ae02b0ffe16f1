"""The staleness contract: what a late averaged gradient does to the weights.

The engine decides WHEN the average of step t-D is applied (D = updates between a gradient's
computation and its application: K-1 in a full width-K pipeline, 0 while synchronous); a
:class:`Staleness` rule decides WHAT that update is. docs/convergence.md gives each rule, its cost
and how it meets momentum. Every rule is bound to one engine's parameters and optimizer; methods
run on the caller's thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import torch
from torch import Tensor

from ..flat import flat_params, set_grads
from ..registry import Registry

REGISTRY: Registry[type[Staleness]] = Registry("staleness", facts=("options", "uses_forward_context", "optimizers",
                                                                    "sync_period", "agrees"))

SYNC_PERIODS = ("step", "round", "any")
"""Where a rule applies (its ``sync_period`` fact): to per-step averaged gradients only (``step``:
it reasons about one step's gradient and the weights it was computed at), to the outer step of a
period-H engine only (``round``: trainer.sync_every > 1, pseudo-gradients), or to either (``any``)."""


class Staleness(ABC):
    """One engine's update rule for averaged gradients that arrive late.

    Call order, per engine step: ``launched(local)`` with this rank's flat gradient just before
    its reduction starts, then zero or more ``apply(avg)`` with averages in launch order; an
    average that is non-finite on some rank is replaced by ``skip()`` on every rank.
    ``options`` names the ``trainer.<key>`` settings the constructor takes.
    """

    name: ClassVar[str]
    options: ClassVar[tuple[str, ...]] = ()
    #: the rule only acts inside ``forward_context()``; the engine warns once if a step ran without it
    uses_forward_context: ClassVar[bool] = False
    #: the optimizers whose update the rule assumes (the optimizer must be an instance of one), or ()
    #: for any optimizer: the rule takes every step through ``optimizer.step()`` (Adam's direction
    #: with Adam) and measures what it needs from the weights, never from an assumed update formula
    optimizers: ClassVar[tuple[type[torch.optim.Optimizer], ...]] = ()
    stepping: bool = False
    #: indices of parameters no rank had a gradient for: ``step_optimizer`` leaves their ``.grad`` None
    without_grad: tuple[int, ...] = ()
    #: one of :data:`SYNC_PERIODS`: per-step gradients, the outer step of trainer.sync_every > 1, or either
    sync_period: ClassVar[str] = "step"
    #: replicas that apply the rule hold identical weights (False: each applies a term of its own, eager's)
    agrees: ClassVar[bool] = True
    #: rounds between a launch and the apply of its average (set by the engine that binds a round rule)
    lateness: float = 0.0

    def bind(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """ValueError (:func:`check_optimizer`) for an optimizer whose update the rule cannot follow."""
        check_optimizer(type(self), optimizer)
        self.params = list(params)
        self.optimizer = optimizer
        self.numel = sum(p.numel() for p in self.params)

    def launched(self, local: Tensor) -> None:
        """This rank's gradient of the step being launched, before any update lands after the
        backward that computed it: the parameters are the ones it was computed at (dc keeps
        them). The reduction will overwrite ``local`` in place, so a strategy that needs it later
        must copy it now."""

    def skip(self) -> None:
        """The oldest launched step's average is dropped (trainer.nonfinite=skip): forget what
        ``launched`` kept for it, as if that step had never run."""

    def filled(self) -> None:
        """A launch that applied nothing (the pipeline filling): called by an engine whose rule
        acts at every launch (:class:`~pipesgd.engine.diloco.PipeDiLoCo`); default: nothing."""

    @abstractmethod
    def apply(self, avg: Tensor) -> None:
        """Update the parameters with the average of the oldest launched step (``avg`` may be
        modified and is left as the parameters' ``.grad`` views)."""

    def step_optimizer(self, grad: Tensor) -> None:
        """The plain rule: ``optimizer.step()`` with every ``p.grad`` a view into ``grad``."""
        set_grads(self.params, grad)
        for i in self.without_grad:
            self.params[i].grad = None  # plain torch: the optimizer skips it (no momentum, no decay)
        self.stepping = True  # the engine's guard lets this optimizer.step() through
        try:
            self.optimizer.step()
        finally:
            self.stepping = False

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


def check_optimizer(rule: type[Staleness], optimizer: torch.optim.Optimizer) -> None:
    """ValueError naming ``staleness=NAME``, the optimizer and the choices, unless ``rule`` runs
    with ``optimizer`` (its ``optimizers`` fact)."""
    if not rule.optimizers or isinstance(optimizer, rule.optimizers):
        return
    general = [name for name in REGISTRY if not REGISTRY.facts(name)["optimizers"]
               and REGISTRY.facts(name)["sync_period"] != "round"]  # rules for per-step gradients, as dga
    wanted = " or ".join(f"{c.__module__}.{c.__qualname__}" for c in rule.optimizers)
    raise ValueError(
        f"staleness={rule.name} assumes the update of {wanted} and cannot run with optimizer "
        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}; use a {wanted} optimizer, or "
        f"staleness={'|'.join(general)}, which take the optimizer's own update")


def register(name: str, **facts):
    """Class decorator: make a rule selectable as ``staleness=<name>`` (its ``options`` and
    ``uses_forward_context`` are class attributes, defaulting to the contract's)."""
    return REGISTRY.register(name, **facts)


def available() -> list[str]:
    return list(REGISTRY)


def rules_besides(sync_period: str) -> list[str]:
    """The registered rules whose ``sync_period`` is not ``sync_period`` (``"step"``: those that can
    apply a round's pseudo-gradient)."""
    return [name for name in REGISTRY if REGISTRY.facts(name)["sync_period"] != sync_period]


def rule_class(name: str) -> type[Staleness]:
    """The class registered as ``name``; ValueError naming the known rules."""
    if name not in REGISTRY:
        raise ValueError(f"staleness={name!r} is not known; allowed: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def make_staleness(name: str | Staleness = "none", **options) -> Staleness:
    """The strategy called ``name``, built from the ``options`` it takes (others are ignored, so
    the caller may pass every ``trainer.*`` staleness setting)."""
    if isinstance(name, Staleness):
        return name
    cls = rule_class(name)
    return cls(**{k: v for k, v in options.items() if k in cls.options})
