"""PipeDiLoCo, the width-K pipeline at a synchronization period H (``trainer.sync_every=H > 1``):
DiLoCo, with its outer step carried by PipeSGD's own schedule. docs/period-h.md draws it.

Every step the inner optimizer steps this replica's weights with its own gradient. Every H steps
(a round) the pseudo-gradient Δ = anchor - weights goes to a :class:`~pipesgd.engine.pipe.PipeSGD`
whose parameters are the anchor and whose optimizer is the outer one: launched now, averaged on
the communication thread through the same reduction, allreduce and compressor a gradient takes
(int8 in the ring, error feedback, the non-finite flag), and applied by the outer rule (``none``:
the plain delayed outer step; ``eager``) K-1 rounds later, when the pipe's schedule says so.
Then the weights start the next round from the anchor. Width 1 is blocking DiLoCo; width 2 keeps
one outer step in flight behind a whole round of compute.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from .. import trace
from ..comm import CommStats
from ..compress import Compressor
from ..flat import assign_params, flat_params, state_to_device
from ..reduction import Reduction
from ..staleness import Staleness, make_staleness
from .base import Engine, StepStats, T
from .pipe import PipeSGD, _broadcast_from_first_rank

OuterFactory = Callable[[list[Tensor]], torch.optim.Optimizer]

DEFAULT_OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
"""The DiLoCo papers' outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""


class PipeDiLoCo(Engine):
    """DiLoCo whose outer step runs through the width-K pipeline.

    ``optimizer`` is the inner optimizer over ``params`` (any ``torch.optim`` optimizer; AdamW in
    the papers); ``step()`` after each ``loss.backward()`` steps it with this rank's own gradient,
    and every ``sync_every`` calls ends a round: the round's pseudo-gradient anchor - params is
    launched, the average of the round ``width - 1`` rounds back is applied to the anchor by
    ``outer_optimizer`` (a callable building an optimizer over the anchor tensors, default
    :data:`DEFAULT_OUTER`) under ``staleness`` (``"none"``, or ``"eager"`` at width 2), and
    ``params`` take the anchor's values. ``flush()`` ends a partial round early and applies every
    round still in flight; afterwards every replica holds the anchor. ``compressor``,
    ``allreduce``, ``group``, ``nonfinite`` and ``timeout_s`` are PipeSGD's, applied to the
    pseudo-gradient: a round whose pseudo-gradient is non-finite on any rank is dropped on every
    rank (``nonfinite="skip"``), and the rank whose own was non-finite also clears its inner
    optimizer's state, which the non-finite steps wrote.

    The anchor is the model every replica trains towards: :meth:`consistent_weights` (evaluation,
    replica checks) puts it into ``params``. With ``"none"`` it is identical on every rank; with
    ``"eager"`` each replica's anchor carries its own freshest pseudo-gradient / M, so replicas
    differ (:attr:`replicas_agree` is False). At construction every rank takes the first rank's
    ``params`` (and ``module``'s buffers), as PipeSGD does. The inner optimizer is this engine's:
    calling ``optimizer.step()`` directly raises, as with PipeSGD.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[Tensor], sync_every: int,
                 width: int = 2, outer_optimizer: OuterFactory | None = None,
                 staleness: str | Staleness = "none", compressor: str | Compressor | Reduction | None = "none",
                 allreduce: str | Callable[..., CommStats] = "auto", group=None, nonfinite: str = "abort",
                 timeout_s: float | None = None, module: torch.nn.Module | None = None):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1 (inner steps per round), got {sync_every!r}")
        rule = make_staleness(staleness)
        if rule.sync_period == "step":
            raise ValueError(f"staleness={rule.name} is a rule for per-step gradients and cannot apply a round's "
                             "pseudo-gradient; use staleness=none or staleness=eager with sync_every")
        if rule.name == "eager" and width != 2:
            raise ValueError(f"staleness=eager keeps exactly one outer step in flight: it needs width=2, got "
                             f"width={width}")
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params has no tensor with requires_grad=True: nothing to train")
        self.sync_every = sync_every
        _broadcast_from_first_rank([*self.params, *(module.buffers() if module is not None else ())], group)
        # The anchor: leaf tensors the outer optimizer steps; requires_grad only so the exchange
        # takes them as parameters (no autograd graph ever reaches them).
        self.anchor = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.outer = (outer_optimizer or DEFAULT_OUTER)(self.anchor)
        self.pipe = PipeSGD(self.outer, self.anchor, width=width, compressor=compressor, allreduce=allreduce,
                            group=group, staleness=rule, nonfinite=nonfinite, timeout_s=timeout_s,
                            pseudo_gradients=True)
        self.rule = self.pipe.staleness
        self.rule.replicas = self.pipe.world_size
        self.width = width
        self.nonfinite = self.pipe.nonfinite
        self.compressor = self.pipe.compressor
        self.replicas_agree = rule.sync_period != "round"
        self.steps = 0
        self.in_round = 0  # inner steps of the round in progress
        self.last = StepStats()
        self._stepping = False
        self._guard = optimizer.register_step_pre_hook(self._check_stepping)

    @property
    def rounds(self) -> int:
        """Rounds launched so far (the pipe's steps)."""
        return self.pipe.steps

    @property
    def in_flight(self) -> int:
        return self.pipe.in_flight

    def step(self) -> StepStats:
        """One inner step with this rank's gradient; at the end of a round, the outer exchange."""
        t0 = time.perf_counter()
        with trace.current().span("update", "update", self.steps):
            self._stepping = True
            try:
                self.optimizer.step()
            finally:
                self._stepping = False
        self.steps += 1
        self.in_round += 1
        if self.in_round < self.sync_every:
            self.last = StepStats(update_s=time.perf_counter() - t0, applied=True)
            return self.last
        stats = self._end_round()
        stats.update_s += time.perf_counter() - t0
        stats.applied = True  # the inner step applied, whatever the outer one did
        self.last = stats
        return stats

    def _end_round(self) -> StepStats:
        """Launch the round's pseudo-gradient, let the pipe apply what is due, restart from the anchor."""
        self.in_round = 0
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                # into the gradient the last outer step left (a buffer the exchange lent and got
                # back): the pipe's flatten then lends that very buffer again, copying nothing
                if a.grad is None:
                    a.grad = torch.empty_like(a)
                torch.sub(a, p, out=a.grad)
        own_bad = not torch.isfinite(torch.stack([a.grad.sum() for a in self.anchor]).sum()).item()
        stats = self.pipe.step()
        if not stats.applied and not stats.skipped:
            self.rule.filled()
        if own_bad:
            self.optimizer.state.clear()  # the non-finite inner steps wrote it; the round is dropped
        assign_params(self.params, flat_params(self.anchor))
        stats.metrics = {**stats.metrics, "outer/round": float(self.rounds),
                         "outer/bytes_per_step": stats.comm.wire_bytes / self.sync_every}
        return stats

    def flush(self) -> StepStats:
        """End a partial round early, apply every round in flight; params = the anchor after."""
        stats = StepStats()
        if self.in_round:
            stats = self._end_round()
        flushed = self.pipe.flush()
        stats.wait_s += flushed.wait_s
        stats.comm += flushed.comm
        stats.applied = stats.applied or flushed.applied
        assign_params(self.params, flat_params(self.anchor))
        return stats

    def _check_stepping(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise RuntimeError("optimizer.step() was called directly on the inner optimizer a PipeDiLoCo engine "
                               "owns; call engine.step() instead (it steps the inner optimizer and ends rounds), "
                               "or engine.close() to release it")

    def consistent_weights(self) -> AbstractContextManager:
        """Inside: ``params`` hold the anchor (this replica's; see :attr:`replicas_agree`)."""
        return self._anchor_in_params()

    @contextlib.contextmanager
    def _anchor_in_params(self) -> Iterator[None]:
        local = flat_params(self.params)
        assign_params(self.params, flat_params(self.anchor))
        try:
            yield
        finally:
            assign_params(self.params, local)

    def collective(self, fn: Callable[[], T], what: str = "a collective") -> T:
        return self.pipe.collective(fn, what)

    def check_replicas(self) -> None:
        """PipeSGD's check on the anchors (``staleness=none``: identical on every rank)."""
        if not self.replicas_agree:
            raise RuntimeError("staleness=eager replicas differ by their own fresh pseudo-gradient by design; "
                               "there is nothing every replica must agree on to check")
        self.pipe.check_replicas()

    shared_state = ("pending", "pending_nonfinite")

    def state_dict(self) -> dict:
        """The pipe's state (rounds in flight, waited for; the outer rule's and the reduction's
        state), the anchor, the outer optimizer, the step within the round, and this rank's own
        weights and inner optimizer state, which differ from rank 0's mid-round (a checkpoint saves
        the model and the optimizer from rank 0 only)."""
        pipe = self.pipe.state_dict()
        return {"width": self.width, "steps": self.steps, "sync_every": self.sync_every, "in_round": self.in_round,
                "pending": pipe.pop("pending"), "pending_nonfinite": pipe.pop("pending_nonfinite"), "pipe": pipe,
                "anchor": flat_params(self.anchor), "outer_optimizer": self.outer.state_dict(),
                "local": flat_params(self.params), "inner_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("width", self.width), ("sync_every", self.sync_every)):
            if state.get(key) != mine:
                raise ValueError(f"checkpoint has {key}={state.get(key)}, engine has {key}={mine}")
        device = self.params[0].device
        state = state_to_device(state, device)
        numel = sum(p.numel() for p in self.params)
        for key in ("anchor", "local"):
            if state[key].numel() != numel:
                raise ValueError(f"checkpoint's {key} has {state[key].numel()} values, model has {numel}")
        self.pipe.load_state_dict({**state["pipe"], "pending": state["pending"],
                                   "pending_nonfinite": state["pending_nonfinite"]})
        assign_params(self.anchor, state["anchor"])
        # copies: torch's load_state_dict keeps the caller's tensors as the momentum buffers it
        # then steps in place, so a state loaded twice (or shared) would be changed under the caller
        self.outer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        assign_params(self.params, state["local"])
        if state.get("inner_optimizer") is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["inner_optimizer"]))
        self.steps, self.in_round = int(state["steps"]), int(state["in_round"])

    def state_for_new_rank(self, state: dict) -> dict:
        """A rank that did not exist before an elastic resume starts its round from the donor's
        anchor with a fresh inner optimizer, owns no pseudo-gradient in flight (eager: zeros) and
        none of the donor's error-feedback residual."""
        pipe = self.pipe.state_for_new_rank(state["pipe"])
        if "own" in pipe.get("staleness", {}):
            pipe = {**pipe, "staleness": {**pipe["staleness"],
                                          "own": [torch.zeros_like(t) for t in pipe["staleness"]["own"]]}}
        return {**state, "pipe": pipe, "local": state["anchor"].clone(), "inner_optimizer": None}

    def summary(self) -> dict:
        return {"sync_every": self.sync_every, "rounds": self.rounds, "outer_rule": self.rule.name}

    def close(self) -> None:
        self._guard.remove()
        self.pipe.close()
