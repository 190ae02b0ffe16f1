"""The engine contract: what the trainer, the reliability hooks and the composition root may call.

Every ``trainer.mode`` builds an :class:`Engine` (docs/architecture.md, "The engine contract").
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from ..comm import CommError, CommStats
from ..compress import Compressor
from ..dist import ReplicaGroups
from ..peers import Peers, RankPeers
from ..reduction import Reduction
from ..staleness import Staleness

T = TypeVar("T")

log = logging.getLogger(__name__)

NONFINITE = ("abort", "skip")


@dataclass
class StepStats:
    """Where the caller's time went inside one ``step()``; ``comm`` is the applied reduction's cost.
    ``staleness``: how many steps old the applied gradient is (0 = this step's; K-1 in a full pipeline).
    ``metrics``: engine-specific scalars for TensorBoard (e.g. ``ps/staleness_mean``).
    ``skipped``: an update was due but dropped because its gradient was non-finite.
    ``wait_spans``: on a GPU, how long the training stream stalled for each reduction (``wait_s``
    is then the host's wait for the communication thread to queue it; :meth:`exposed_s`).
    ``loss``: from an engine that :attr:`~Engine.averages_loss`, the mean of the losses carried
    into the reduction this call voted on (launched a step earlier) by the replicas that
    contributed to it; None where there is none (the vote dropped it, nobody contributed, or the
    engine does not average the loss)."""

    pack_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    applied: bool = False
    comm: CommStats = field(default_factory=CommStats)
    staleness: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    wait_spans: tuple = ()
    loss: float | None = None

    def exposed_s(self) -> float:
        """Communication the caller waited for: the device's stalls where it timed them (reading
        waits for them: call lazily), else ``wait_s``."""
        return sum(s.seconds() for s in self.wait_spans) if self.wait_spans else self.wait_s


class ReductionError(CommError):
    """A reduction this rank waited for failed or did not finish within the engine's timeout."""


class NonFiniteGradient(FloatingPointError):
    """A step's averaged gradient is non-finite and the policy says stop (raised on every rank)."""


class NonFinitePolicy:
    """What every rank does with an update whose gradient is non-finite somewhere: ``abort``
    raises :class:`NonFiniteGradient`; ``skip`` drops the update, but raises after
    ``max_in_a_row`` consecutive skips (a run whose weights are already NaN only ever skips).
    Callers feed it the same decisions in the same order on every rank, so its state agrees."""

    def __init__(self, mode: str = "abort", max_in_a_row: int = 10):
        if mode not in NONFINITE:
            raise ValueError(f"nonfinite={mode!r} is not known; allowed: {', '.join(NONFINITE)}")
        self.mode, self.max_in_a_row = mode, max_in_a_row
        self.in_a_row = 0
        self.skipped: list[int] = []

    def bad(self, step: int, where: str) -> None:
        """Step ``step``'s gradient is non-finite (``where`` says on which ranks): log and skip, or raise."""
        what = f"non-finite gradient at step {step} ({where})"
        if self.mode == "abort":
            raise NonFiniteGradient(f"{what}; trainer.nonfinite=abort stops every rank (set "
                                    "trainer.nonfinite=skip to drop such steps, or lower the learning rate)")
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteGradient(f"{what}: the {self.in_a_row}th such step in a row; stopping because "
                                    "skipping no longer helps (are the weights already non-finite?)")
        self.skipped.append(step)
        log.warning("%s: update skipped on every rank (trainer.nonfinite=skip)", what)

    def good(self) -> None:
        self.in_a_row = 0

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), [int(s) for s in state["skipped"]]


class Engine(ABC):
    """One data-parallel update scheme behind one surface.

    ``step()`` after each ``loss.backward()`` (instead of ``optimizer.step()``), ``flush()`` once at
    the end; ``forward_context()`` wraps each forward and backward, ``consistent_weights()`` each
    evaluation and replica check. ``state_dict()`` holds ``width``, ``steps`` and ``pending`` (the
    in-flight gradients; ``[]`` when nothing is in flight) and may wait for in-flight work, never
    apply it. ``width``: in-flight reductions + 1 (1 = synchronous). ``nonfinite``: the policy all
    ranks decide a non-finite gradient with, or None when this engine cannot decide it together
    (the trainer then stops a rank whose loss is non-finite). ``summary()``: run-level fields for
    summary.json. ``close()`` releases threads; the engine is also a context manager doing that.
    ``averages_loss``: ``step()`` carries the loss handed to :meth:`carry_loss` with its reduction
    and returns the replicas' mean a step later (``StepStats.loss``); the loop then logs that
    mean as the training loss of the step before, instead of this replica's own.
    """

    width: int = 1  # Mode.width's default too: the modes of fixed width run at 1 (pipesgd.modes checks it)
    nonfinite: NonFinitePolicy | None = None
    steps: int = 0
    last: StepStats
    #: keys of :meth:`state_dict` identical on every rank by construction (in-flight averages): a
    #: checkpoint saves them once, from rank 0; the rest is per rank
    shared_state: tuple[str, ...] = ("pending",)
    averages_loss: bool = False
    #: the replicas' weights (:meth:`consistent_weights`) are identical after every step, so replica
    #: checks apply; an engine whose rule lets them differ by design says False
    replicas_agree: bool = True
    #: :meth:`load_state_dict` only on an engine that has not stepped yet (a resume's), not mid-run:
    #: an engine around code that builds its state once (torchft's DiLoCo) says True
    loads_before_first_step: bool = False

    def state_for_new_rank(self, state: dict) -> dict:
        """The per-rank part of a surviving rank's :meth:`state_dict` as a rank that did not exist
        before an elastic resume should load it (what is dropped; default: all of it is kept)."""
        return state

    @abstractmethod
    def step(self) -> StepStats:
        """This step's update (or launch); the stats of whatever was applied."""

    @abstractmethod
    def flush(self) -> StepStats:
        """Apply everything still in flight; afterwards every replica holds the final weights."""

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        ...

    def carry_loss(self, loss: torch.Tensor) -> None:
        """This step's loss (a 0-d tensor, detached), handed over before ``step()``; an engine that
        :attr:`averages_loss` sends it with the step's reduction (default: not used)."""

    def forward_context(self) -> AbstractContextManager:
        """The weights the next forward and backward should see (default: the current ones)."""
        return nullcontext()

    def consistent_weights(self) -> AbstractContextManager:
        """Inside: the parameters every replica agrees on (default: they already do)."""
        return nullcontext()

    def collective(self, fn: Callable[[], T], what: str = "a collective") -> T:
        """Run ``fn`` (collectives of the caller's, on any group) in one order with this engine's
        own communication on every rank, and return its result. NCCL needs that order when two
        groups are driven while reductions are in flight; an engine with a communication thread
        runs ``fn`` there, after the reductions already queued. Default: ``fn()`` here."""
        return fn()

    def peers(self) -> Peers:
        """Who the loop's own collectives (evaluation's buffer and loss averages, its sums) run
        with; default: every rank of torch.distributed's default group, through :meth:`collective`."""
        return RankPeers(self.collective)

    def register_state(self, key: str, save: Callable[[], object], load: Callable[[object], None]) -> None:
        """State outside the engine (the scheduler, the loop's step) that a replica healing from
        this one must also take (``trainer.mode=live``); default: no replica heals from another."""

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ModeArgs:
    """What a mode's builder gets from the composition root; ``width`` is already the mode's own."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    width: int
    compressor: Compressor | Reduction
    allreduce: Callable[..., CommStats]
    group: object | None
    world_size: int
    warmup_sync_steps: int
    device: torch.device
    staleness: str | Staleness = "none"
    nonfinite: str = "abort"
    timeout_s: float | None = None
    check_every: int | None = None  # trainer.check_every where the mode's reductions carry the check, else None
    sync_every: int = 1  # trainer.sync_every: inner steps per round (modes with the sync_every fact)
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None  # at sync_every > 1
    fragments: int = 1  # trainer.fragments: streaming fragments at sync_every > 1
    sync_delay: int = 0  # trainer.sync_delay: steps a round's exchange has before it is waited for (sync_delay modes)
    landing_alpha: float | None = None  # trainer.landing_alpha: the local weights' share where a delayed round lands
    fragment_layout: str = "contiguous"  # trainer.fragment_layout: contiguous runs, or layers dealt round-robin
    replicas: ReplicaGroups | None = None  # dist.ranks_per_replica > 1: the replicas' and the rank peers' groups
