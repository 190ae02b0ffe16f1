"""PipeDiLoCo, the width-K pipeline at a synchronization period H (``trainer.sync_every=H > 1``):
DiLoCo, with its outer step carried by PipeSGD's own schedule. docs/period-h.md draws it.

Every step the inner optimizer steps this replica's weights with its own gradient. Every H steps
(a round) the pseudo-gradient Δ = anchor - weights goes to a :class:`~pipesgd.engine.pipe.PipeSGD`
whose parameters are the anchor and whose optimizer is the outer one: launched now, averaged on
the communication thread through the same reduction, allreduce and compressor a gradient takes
(int8 in the ring, error feedback, the non-finite flag), and applied by the outer rule (``none``:
the plain delayed outer step; ``eager``) K-1 rounds later, when the pipe's schedule says so.
Then the weights start the next round from the anchor. Width 1 is blocking DiLoCo; width 2 keeps
one outer step in flight behind a whole round of compute. With ``fragments=F`` (streaming DiLoCo)
the parameters are F contiguous fragments, each with its own anchor, outer optimizer and pipe, whose
rounds end at staggered steps (fragment f at steps ≡ (f+1)·H/F mod H), so an exchange carries 1/F
of the model every H/F steps; the pipes share one communication thread, which keeps their
collectives in one order on every rank. ``sync_delay=τ`` (0 < τ < H/F, width 2) lands each
fragment's exchange τ steps after its launch instead of at its next round's end, keeping the τ
steps trained since on top of the new anchor (the streaming paper's overlap, late by τ steps
instead of a round): under ``none`` the weights train on from where the round ended, under
``eager`` from the anchor with this replica's own Δ / M applied. With ``replicas`` of k ranks each,
a replica's inner steps are synchronous data parallelism over its ranks and the rounds are
exchanged between replicas in shards by rank peers (:mod:`pipesgd.engine.replica`).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from .. import outer as outer_defaults
from .. import period
from ..observability import trace
from ..comm import CommStats, CommThread
from ..compress import Compressor
from ..dist import ReplicaGroups
from ..flat import assign_params, flat_params, has_nonfinite, state_to_device
from ..reduction import Reduction
from ..staleness import Staleness, make_staleness, rules_besides
from .base import Engine, StepStats, T
from .parity import broadcast_from_first_rank
from .pipe import PipeSGD
from .replica import InnerSteps, sharded_exchange

OuterFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


class _Fragment:
    """One contiguous slice of the parameters: its anchor, outer optimizer and pipe, and the
    inner step (1..H) its rounds end at."""

    def __init__(self, params: list[Tensor], offset: int, outer: OuterFactory, pipe_args: dict):
        self.params, self.offset = params, offset
        # The anchor: leaf tensors the outer optimizer steps; requires_grad only so the exchange
        # takes them as parameters (no autograd graph ever reaches them).
        self.anchor = [p.detach().clone().requires_grad_(True) for p in params]
        self.outer = outer(self.anchor)
        self.pipe = PipeSGD(self.outer, self.anchor, pseudo_gradients=True, **pipe_args)
        self.rule = self.pipe.staleness
        self.rule.replicas = self.pipe.world_size
        self.numel = sum(p.numel() for p in params)
        # sync_delay under ``none``: the weights at the launch, while its round is in flight (the
        # weights train on from them instead of restarting from the anchor); None otherwise
        self.launched_at: Tensor | None = None
        # replicas of several ranks: an inner step of this round was non-finite (and not applied)
        self.inner_nonfinite = False

    def end_round(self, keep_local: bool = False) -> StepStats:
        """Launch the round's pseudo-gradient, let the pipe apply what is due, restart from the
        anchor; ``keep_local`` (sync_delay under ``none``): train on from the weights as they are
        instead, until the average lands (:meth:`land`), unless this replica's were non-finite."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                # into the gradient the last outer step left (a buffer the exchange lent and got
                # back): the pipe's flatten then lends that very buffer again, copying nothing
                if a.grad is None:
                    a.grad = torch.empty_like(a)
                torch.sub(a, p, out=a.grad)
            if self.inner_nonfinite:  # the round is non-finite, as a replica of one rank's would be
                self.anchor[0].grad.view(-1)[0] = float("nan")
                self.inner_nonfinite = False
        own_bad = bool(has_nonfinite(torch.stack([a.grad.sum() for a in self.anchor])))
        stats = self.pipe.step()
        if not stats.applied and not stats.skipped:
            self.rule.filled()
        stats.metrics = {"own_nonfinite": float(own_bad)}
        if keep_local and not own_bad:
            self.launched_at = flat_params(self.params)
        else:
            self.restart()
        return stats

    def land(self, alpha: float | None = None) -> StepStats:
        """Wait for the exchange in flight and apply it to the anchor (``sync_delay``), then merge
        the inner steps trained since the launch: by default keep them on top of it (the weights
        become the new anchor plus what they moved since the launch, :attr:`launched_at`, or,
        where they restarted from the anchor at the launch, move by what the anchor moved); with
        ``alpha`` = α, streaming DiLoCo's mix: θ ← α·θ + (1 − α)·anchor."""
        before = self.launched_at if self.launched_at is not None else flat_params(self.anchor)
        stats = self.pipe.flush()
        with torch.no_grad():
            if alpha is None:
                moved = flat_params(self.anchor).sub_(before)
                assign_params(self.params, flat_params(self.params).add_(moved))
            else:
                assign_params(self.params, flat_params(self.params).mul_(alpha).add_(flat_params(self.anchor),
                                                                                     alpha=1.0 - alpha))
        self.launched_at = None
        return stats

    def restart(self) -> None:
        assign_params(self.params, flat_params(self.anchor))
        self.launched_at = None


def split(params: list[Tensor], fragments: int) -> list[list[Tensor]]:
    """``params`` in order, cut into ``fragments`` contiguous runs of about equal numel (each at
    least one tensor); ValueError if there are fewer tensors than fragments."""
    if fragments > len(params):
        raise ValueError(f"fragments={fragments} is more than the model's {len(params)} parameter tensors")
    total = sum(p.numel() for p in params)
    out: list[list[Tensor]] = [[]]
    seen = 0
    for i, p in enumerate(params):
        left = len(params) - i  # tensors still to place, this one included
        cut = seen >= total * len(out) / fragments or fragments - len(out) >= left
        if out[-1] and cut and len(out) < fragments:
            out.append([])
        out[-1].append(p)
        seen += p.numel()
    return out


def layer_of(name: str) -> str:
    """The layer a parameter belongs to by its name: up to its first numeric part ("blocks.3" of
    "blocks.3.attn.weight"), else the name itself (an embedding, the final norm: a layer alone)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name


def split_strided(params: list[Tensor], names: list[str], fragments: int) -> list[list[Tensor]]:
    """``params`` grouped by layer (:func:`layer_of` of ``names``, in order of first appearance),
    layer g to fragment g mod ``fragments``, so each fragment holds layers from the whole depth;
    ValueError if there are fewer layers than fragments."""
    layers: dict[str, list[Tensor]] = {}
    for p, name in zip(params, names):
        layers.setdefault(layer_of(name), []).append(p)
    if fragments > len(layers):
        raise ValueError(f"fragments={fragments} is more than the model's {len(layers)} layers "
                         f"(fragment_layout=strided deals whole layers)")
    out: list[list[Tensor]] = [[] for _ in range(fragments)]
    for g, group in enumerate(layers.values()):
        out[g % fragments].extend(group)
    return out


class PipeDiLoCo(Engine):
    """DiLoCo whose outer step runs through the width-K pipeline.

    ``optimizer`` is the inner optimizer over ``params`` (any ``torch.optim`` optimizer; AdamW in
    the papers); ``step()`` after each ``loss.backward()`` steps it with this rank's own gradient,
    and every ``sync_every`` calls ends a round: the round's pseudo-gradient anchor - params is
    launched, the average of the round ``width - 1`` rounds back is applied to the anchor by
    ``outer_optimizer`` (a callable building an optimizer over the anchor tensors, default
    :func:`pipesgd.outer.settings` for this H and the replicas) under ``staleness`` (``"none"``, or ``"eager"`` at width 2), and
    ``params`` take the anchor's values. ``flush()`` ends a partial round early and applies every
    round still in flight; afterwards every replica holds the anchor. ``compressor``,
    ``allreduce``, ``group``, ``nonfinite`` and ``timeout_s`` are PipeSGD's, applied to the
    pseudo-gradient: a round whose pseudo-gradient is non-finite on any rank is dropped on every
    rank (``nonfinite="skip"``), and the rank whose own was non-finite also clears its inner
    optimizer's state, which the non-finite steps wrote. ``fragments=F`` (a divisor of
    ``sync_every``) streams the model in F staggered fragments (the module docstring).
    ``fragment_layout="strided"`` (with ``module``) deals whole layers round-robin instead of cutting
    contiguous runs (:func:`split_strided`). ``sync_delay=τ`` (width 2, 0 < τ < sync_every / fragments) applies each round's average τ
    inner steps after its launch instead of at the next round's end, and keeps the τ steps
    trained since on top of the new anchor: under ``"none"`` ``params`` train on from where the
    round ended and become the new anchor plus what they moved since; under ``"eager"`` this
    replica's own Δ / M is applied at the launch, ``params`` restart from that anchor and move by
    what the others' part moves it when it lands. 0: the whole round. ``landing_alpha=α`` mixes
    instead at the landing, ``params`` ← α·params + (1 − α)·anchor (streaming DiLoCo's merge);
    ``"auto"``: the share that follows the number of replicas, :func:`pipesgd.outer.landing_alpha`.

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
                 timeout_s: float | None = None, module: torch.nn.Module | None = None, fragments: int = 1,
                 sync_delay: int = 0, warmup_sync_steps: int = 0, landing_alpha: float | str | None = None,
                 fragment_layout: str = "contiguous", replicas: ReplicaGroups | None = None):
        rule = make_staleness(staleness)
        period.check(sync_every, fragments, sync_delay, width=width, rule=rule.name, rule_period=rule.sync_period,
                     rule_agrees=rule.agrees, round_rules=rules_besides("step"))
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params has no tensor with requires_grad=True: nothing to train")
        found = period.merge_problems(warmup_sync_steps, landing_alpha, sync_delay, fragment_layout)
        if found:
            raise ValueError("; ".join(found))
        self.sync_every, self.width, self.sync_delay = sync_every, width, sync_delay
        self.warmup_sync_steps, self.landing_alpha = warmup_sync_steps, landing_alpha
        self.steps = 0  # inner steps: the tick every fragment's schedule launches and lands at
        broadcast_from_first_rank([*self.params, *(module.buffers() if module is not None else ())], group)
        # the synchronous steps before the first round: each step's gradient averaged (width 1) and
        # stepped by the inner optimizer, so rounds start from a data-parallel model
        self._warmup = None if not warmup_sync_steps else PipeSGD(
            optimizer, self.params, width=1, compressor=copy.deepcopy(compressor), allreduce=allreduce, group=group,
            nonfinite=nonfinite, timeout_s=timeout_s)
        # fragments share one communication thread: one FIFO keeps their collectives in one order
        self._thread = CommThread() if fragments > 1 else None
        step = sync_every // fragments
        # one rule and one compressor per fragment (their state is the fragment's), copied unbound
        rules = [rule, *(copy.deepcopy(rule) for _ in range(fragments - 1))]
        compressors = [compressor, *(copy.deepcopy(compressor) for _ in range(fragments - 1))]
        # replicas of k > 1 ranks: rounds between replicas over the rank peers, in shards
        self.replicas = replicas if replicas is not None and replicas.k > 1 else None
        outer_group, allreduces = group, [allreduce] * fragments
        if self.replicas is not None:
            outer_group = self.replicas.peers
            compressors, allreduces = zip(*(sharded_exchange(c, allreduce, self.replicas) for c in compressors))
        outer = outer_optimizer or outer_defaults.factory(sync_every, _replicas(outer_group))
        if landing_alpha == period.AUTO:  # the local weights' share that follows M
            self.landing_alpha = outer_defaults.landing_alpha(_replicas(outer_group))
        self.fragments = [
            _Fragment(part, (f + 1) * step, outer,
                      dict(width=width, compressor=compressors[f], allreduce=allreduces[f], group=outer_group,
                           staleness=rules[f], nonfinite=nonfinite, timeout_s=timeout_s, comm_thread=self._thread,
                           delay=sync_delay, clock=self._tick))
            for f, part in enumerate(self._split(fragments, fragment_layout, module))]
        first = self.fragments[0]
        self.rule = first.rule
        self.nonfinite = first.pipe.nonfinite if fragments == 1 else _Policies([f.pipe for f in self.fragments])
        self.compressor = first.pipe.compressor
        self.replicas_agree = rule.agrees
        for f in self.fragments:  # rounds from a launch to its apply, for a rule that scales by it
            f.rule.lateness = sync_delay / sync_every if sync_delay else float(width - 1)
        self.last = StepStats()
        self._stepping = False
        self._guard = optimizer.register_step_pre_hook(self._check_stepping)
        self._timeout_s = timeout_s
        self._inner: InnerSteps | None = None  # replicas of k > 1 ranks, after the warm-up
        if self._warmup is None:
            self._start_inner()

    def _start_inner(self) -> None:
        """Replicas of several ranks: the inner steps' averaging over the replica (built once no
        warm-up owns the inner optimizer: each width-1 pipe guards its optimizer's step)."""
        if self.replicas is not None and self._inner is None:
            self._inner = InnerSteps(self.optimizer, self.params, self.replicas.inner, self._timeout_s)

    def _split(self, fragments: int, layout: str, module: torch.nn.Module | None) -> list[list[Tensor]]:
        if layout == "contiguous" or fragments == 1:
            return split(self.params, fragments)
        if module is None:
            raise ValueError("fragment_layout=strided deals the model's layers by parameter name: pass module=")
        names = {id(p): n for n, p in module.named_parameters()}
        return split_strided(self.params, [names.get(id(p), "") for p in self.params], fragments)

    def _tick(self) -> int:
        return self.steps

    @property
    def anchor(self) -> list[Tensor]:
        return [a for f in self.fragments for a in f.anchor]

    @property
    def rounds(self) -> int:
        """Rounds launched so far (by the last fragment, the whole model's when unfragmented)."""
        return self.fragments[-1].pipe.steps

    @property
    def in_round(self) -> int:
        """Inner steps since the last fragment's round ended (0 during the synchronous warm-up)."""
        return max(0, self.steps - self.warmup_sync_steps) % self.sync_every

    def _round_clock(self) -> int:
        """Inner steps since the rounds started (after ``warmup_sync_steps``); <= 0 before."""
        return self.steps - self.warmup_sync_steps

    @property
    def in_flight(self) -> int:
        return sum(f.pipe.in_flight for f in self.fragments)

    def step(self) -> StepStats:
        """One inner step with this rank's gradient; the outer exchange of each fragment whose round ends here."""
        if self._warmup is not None:
            return self._warmup_step()
        t0 = time.perf_counter()
        with trace.current().span("update", "update", self.steps):
            self._stepping = True
            try:
                inner = None if self._inner is None else self._inner.step()
                if inner is None:
                    self.optimizer.step()
            finally:
                self._stepping = False
        self.steps += 1
        # a round lands when its fragment's schedule says (sync_delay steps after its launch), else
        # by its pipe's width at the fragment's next round end
        landing = [f for f in self.fragments if f.pipe.schedule.due(self.steps)]
        clock = self._round_clock()
        due = [f for f in self.fragments if (clock - f.offset) % self.sync_every == 0]
        stats = self._land(landing) if landing else StepStats()
        if due:
            _merge(stats, self._end_rounds(due))
        if inner is not None:  # the replica's averaging: its wait is exposed, its bytes the fast fabric's
            stats.wait_s += inner.wait_s
            stats.metrics["inner/bytes"] = float(inner.comm.wire_bytes)
            for f in self.fragments if inner.skipped else ():
                f.inner_nonfinite = True
        stats.update_s += time.perf_counter() - t0
        stats.applied = True  # the inner step applied, whatever the outer one did
        self.last = stats
        return stats

    def _warmup_step(self) -> StepStats:
        """A synchronous step: this step's averaged gradient, stepped by the inner optimizer; the
        last one starts the rounds from the weights it leaves (every replica's, identical)."""
        self._stepping = True
        try:
            stats = self._warmup.step()
        finally:
            self._stepping = False
        self.steps += 1
        if self.steps >= self.warmup_sync_steps:
            self._start_rounds()
        self.last = stats
        return stats

    def _start_rounds(self) -> None:
        """The warm-up is over: every fragment's anchor takes the weights (the outer optimizers,
        never stepped yet, start fresh)."""
        self._warmup.close()
        self._warmup = None
        self._anchors_from_weights()
        self._start_inner()

    def _anchors_from_weights(self) -> None:
        for f in self.fragments:
            assign_params(f.anchor, flat_params(f.params))

    def _end_rounds(self, fragments: list[_Fragment]) -> StepStats:
        stats = StepStats()
        own_bad = False
        keep_local = bool(self.sync_delay) and self.rule.agrees  # eager's kind restarts from its own anchor
        for f in fragments:
            s = f.end_round(keep_local)
            own_bad |= bool(s.metrics.pop("own_nonfinite"))
            _merge(stats, s)
        if own_bad:
            self.optimizer.state.clear()  # the non-finite inner steps wrote it; the round is dropped
        stats.metrics = {"outer/round": float(self.rounds)}
        if not self.sync_delay:  # the bytes of the round whose average was applied (none yet at the fill)
            stats.metrics["outer/bytes_per_step"] = stats.comm.wire_bytes * len(self.fragments) / self.sync_every
        return stats

    def _land(self, fragments: list[_Fragment]) -> StepStats:
        """The exchanges launched ``sync_delay`` steps ago: waited for and applied (:meth:`_Fragment.land`)."""
        stats = StepStats()
        for f in fragments:
            _merge(stats, f.land(self.landing_alpha))
        stats.metrics = {"outer/bytes_per_step": stats.comm.wire_bytes * len(self.fragments) / self.sync_every}
        return stats

    def flush(self) -> StepStats:
        """End partial rounds early, apply every round in flight; params = the anchor after
        (during the synchronous warm-up: the anchor takes the weights)."""
        if self._warmup is not None:
            stats = self._warmup.flush()
            self._anchors_from_weights()
            return stats
        # sync_delay: what is in flight lands first, as it would have before the next launch
        landing = [f for f in self.fragments if self.sync_delay and f.pipe.in_flight]
        stats = self._land(landing) if landing else StepStats()
        clock = self._round_clock()
        partial = [f for f in self.fragments if clock > 0 and (clock - f.offset) % self.sync_every]
        if partial:
            _merge(stats, self._end_rounds(partial))
        for f in self.fragments:
            flushed = f.pipe.flush()
            stats.wait_s += flushed.wait_s
            stats.comm += flushed.comm
            stats.applied = stats.applied or flushed.applied
            f.restart()
        return stats

    def _check_stepping(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise RuntimeError("optimizer.step() was called directly on the inner optimizer a PipeDiLoCo engine "
                               "owns; call engine.step() instead (it steps the inner optimizer and ends rounds), "
                               "or engine.close() to release it")

    def consistent_weights(self) -> AbstractContextManager:
        """Inside: ``params`` hold the anchor (this replica's; see :attr:`replicas_agree`); during
        the synchronous warm-up, the weights themselves (every replica's)."""
        return contextlib.nullcontext() if self._warmup is not None else self._anchor_in_params()

    @contextlib.contextmanager
    def _anchor_in_params(self) -> Iterator[None]:
        local = flat_params(self.params)
        for f in self.fragments:  # fragment by fragment: a strided fragment is not a run of params
            assign_params(f.params, flat_params(f.anchor))
        try:
            yield
        finally:
            assign_params(self.params, local)

    def collective(self, fn: Callable[[], T], what: str = "a collective") -> T:
        return (self._warmup or self.fragments[0].pipe).collective(fn, what)

    def check_replicas(self) -> None:
        """PipeSGD's check on each fragment's anchor (``staleness=none``: identical on every rank)."""
        if self._warmup is not None:
            return self._warmup.check_replicas()
        if not self.replicas_agree:
            raise RuntimeError("staleness=eager replicas differ by their own fresh pseudo-gradient by design; "
                               "there is nothing every replica must agree on to check")
        for f in self.fragments:  # with replicas of several ranks: the anchors of the rank peers
            f.pipe.check_replicas()
        if self._inner is not None:  # and the ranks of a replica hold the same weights
            self._inner.check_replicas()

    shared_state = ("pending", "pending_nonfinite")

    def state_dict(self) -> dict:
        """Per fragment, the pipe's state (rounds in flight, waited for; the outer rule's and the
        reduction's state), the anchor and the outer optimizer; the step; and this rank's own
        weights and inner optimizer state, which differ from rank 0's mid-round (a checkpoint saves
        the model and the optimizer from rank 0 only). ``pending``: one list per fragment."""
        pipes = [f.pipe.state_dict() for f in self.fragments]
        return {"width": self.width, "steps": self.steps, "sync_every": self.sync_every,
                "fragments": len(self.fragments), "sync_delay": self.sync_delay,
                "warmup_sync_steps": self.warmup_sync_steps,
                "warmup": None if self._warmup is None else self._warmup.state_dict(),
                "pending": [p.pop("pending") for p in pipes],
                "pending_nonfinite": [p.pop("pending_nonfinite") for p in pipes], "pipes": pipes,
                "anchor": flat_params(self.anchor), "outer_optimizers": [f.outer.state_dict() for f in self.fragments],
                "local": flat_params(self.params), "inner_optimizer": self.optimizer.state_dict(),
                "launched_at": [f.launched_at for f in self.fragments], **self._replica_state()}

    def _replica_state(self) -> dict:
        """Replicas of several ranks: k, the inner steps' state and the rounds marked non-finite."""
        if self.replicas is None:
            return {}
        return {"ranks_per_replica": self.replicas.k, "inner": None if self._inner is None else self._inner.state_dict(),
                "inner_nonfinite": [f.inner_nonfinite for f in self.fragments]}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("width", self.width), ("sync_every", self.sync_every), ("fragments", len(self.fragments)),
                          ("sync_delay", self.sync_delay), ("warmup_sync_steps", self.warmup_sync_steps)):
            # checkpoints from before sync_delay and the warm-up existed ran without them
            if state.get(key, 0 if key in ("sync_delay", "warmup_sync_steps") else None) != mine:
                raise ValueError(f"checkpoint has {key}={state.get(key)}, engine has {key}={mine}")
        k = 1 if self.replicas is None else self.replicas.k
        if state.get("ranks_per_replica", 1) != k:  # another split of the ranks: shards and weights would not fit
            raise ValueError(f"checkpoint has dist.ranks_per_replica={state.get('ranks_per_replica', 1)}, this run "
                             f"has {k}: a run resumes with the replicas' size it was written with")
        device = self.params[0].device
        state = state_to_device(state, device)
        numel = sum(p.numel() for p in self.params)
        for key in ("anchor", "local"):
            if state[key].numel() != numel:
                raise ValueError(f"checkpoint's {key} has {state[key].numel()} values, model has {numel}")
        anchors = state["anchor"].split([f.numel for f in self.fragments])
        steps = int(state["steps"])
        for f, pipe, pending, flags, anchor, outer in zip(self.fragments, state["pipes"], state["pending"],
                                                          state["pending_nonfinite"], anchors,
                                                          state["outer_optimizers"]):
            # launch ticks (inner steps) of checkpoints from before they were saved: the fragment's
            # round ends, the newest the last one at or before the step
            last = steps - (steps - self.warmup_sync_steps - f.offset) % self.sync_every
            at = pipe.get("pending_at") or [last - (len(pending) - 1 - i) * self.sync_every for i in range(len(pending))]
            f.pipe.load_state_dict({**pipe, "pending": pending, "pending_nonfinite": flags, "pending_at": at})
            assign_params(f.anchor, anchor)
            # a copy: torch's load_state_dict keeps the caller's tensors as the momentum buffers it
            # then steps in place, so a state loaded twice (or shared) would change under the caller
            f.outer.load_state_dict(copy.deepcopy(outer))
        assign_params(self.params, state["local"])
        for f, at in zip(self.fragments, state.get("launched_at") or [None] * len(self.fragments)):
            f.launched_at = None if at is None else at.clone()
        if state.get("inner_optimizer") is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["inner_optimizer"]))
        self.steps = int(state["steps"])
        if self._warmup is not None:
            if state.get("warmup") is not None:
                self._warmup.load_state_dict(state["warmup"])
            else:  # saved after the warm-up: the rounds it started are in the state loaded above
                self._warmup.close()
                self._warmup = None
                self._start_inner()
        if self._inner is not None and state.get("inner") is not None:
            self._inner.load_state_dict(state["inner"])
        for f, bad in zip(self.fragments, state.get("inner_nonfinite") or [False] * len(self.fragments)):
            f.inner_nonfinite = bool(bad)

    def state_for_new_rank(self, state: dict) -> dict:
        """A rank that did not exist before an elastic resume starts its round from the donor's
        anchor with a fresh inner optimizer, owns no pseudo-gradient in flight (eager: zeros) and
        none of the donor's error-feedback residual."""
        pipes = []
        for f, pipe in zip(self.fragments, state["pipes"]):
            pipe = f.pipe.state_for_new_rank(pipe)
            if "own" in pipe.get("staleness", {}):
                pipe = {**pipe, "staleness": {**pipe["staleness"],
                                              "own": [torch.zeros_like(t) for t in pipe["staleness"]["own"]]}}
            pipes.append(pipe)
        # it starts from the anchor: its steps since a launch are all it moves from there
        return {**state, "pipes": pipes, "local": state["anchor"].clone(), "inner_optimizer": None,
                "launched_at": [None] * len(self.fragments)}

    def summary(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": len(self.fragments), "sync_delay": self.sync_delay,
                "warmup_sync_steps": self.warmup_sync_steps, "landing_alpha": self.landing_alpha,
                "rounds": self.rounds, "outer_rule": self.rule.name,
                "outer_step": outer_defaults.describe(self.fragments[0].outer), **self._replica_summary()}

    def _replica_summary(self) -> dict:
        """Replicas of several ranks: what this rank sent inside its replica (the fast fabric: the
        inner steps' averages and the gathers of the summed shards); the slow link's bytes are
        ``mean_bytes_per_step``'s."""
        if self.replicas is None:
            return {}
        gathered = sum(f.pipe.compressor.gathered_bytes for f in self.fragments)
        inner = 0 if self._inner is None else self._inner.sent_bytes
        return {"bytes_inside_replica": inner + gathered, "bytes_inside_replica_gathers": gathered}

    def close(self) -> None:
        self._guard.remove()
        if self._warmup is not None:
            self._warmup.close()
        if self._inner is not None:
            self._inner.close()
        for f in self.fragments:
            f.pipe.close()
        if self._thread is not None:
            self._thread.close()


def _replicas(group) -> int:
    """How many replicas exchange over ``group`` (the world where it is None; 1 alone)."""
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _merge(into: StepStats, s: StepStats) -> StepStats:
    """Add one fragment's costs and flags to ``into`` (metrics are the caller's)."""
    into.pack_s += s.pack_s
    into.wait_s += s.wait_s
    into.update_s += s.update_s
    into.comm += s.comm
    into.wait_spans += s.wait_spans
    into.skipped |= s.skipped
    into.applied |= s.applied
    into.staleness = max(into.staleness, s.staleness)
    into.metrics = {**into.metrics, **s.metrics}
    return into


class _Policies:
    """The fragments' non-finite policies as one (what the trainer and the summary read)."""

    def __init__(self, pipes: list[PipeSGD]):
        self._policies = [p.nonfinite for p in pipes]

    @property
    def skipped(self) -> list[int]:
        return sorted(s for p in self._policies for s in p.skipped)
