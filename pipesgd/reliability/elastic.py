"""Resuming a checkpoint on another number of ranks: the rule for each piece of state.

Pure functions on a checkpoint's contents; :class:`pipesgd.reliability.hooks.Reliability` applies them
when ``trainer.elastic=true`` and the world size changed (docs/reliability.md, "Elastic resume").

* In-flight averaged gradients (shared): averages over the old world, applied as they are.
* Per-rank state of rank ``r`` at the new world: old rank ``r``'s if it existed, else old rank
  ``r mod W_old``'s ("a surviving rank"), as the engine says a new rank takes it
  (``Engine.state_for_new_rank``: PipeSGD never copies an error-feedback residual, gradient mass
  only its own rank still owes the average, so a new rank starts at zero; a removed rank's
  residual is dropped). RNG of a new rank: the donor's, then torch reseeded from
  (step, rank) so two ranks never draw the same stream.
* Data position: samples of the epoch's permutation already trained, world-independent
  (:class:`pipesgd.data.loader.ShardedLoader` deals out the rest).
* Step and schedule: the step counter becomes the one the new world would have at the same
  point of the same epoch, so the schedule (a function of step / total steps) continues at the
  same fraction of training; updates not yet applied stay not applied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

def donor(rank: int, old_world: int) -> int:
    """The old rank whose per-rank state rank ``rank`` of the new world takes."""
    return rank if rank < old_world else rank % old_world


def rank_state(ranks: list[dict], rank: int, new_rank_engine: Callable[[dict], dict] = lambda s: s) -> dict:
    """Rank ``rank``'s per-rank checkpoint state at the new world (see the module docstring);
    ``new_rank_engine``: the engine's own migration of a donor's engine state (its
    ``state_for_new_rank``)."""
    old_world = len(ranks)
    src = ranks[donor(rank, old_world)]
    if rank < old_world:
        return src
    return {**src, "engine": new_rank_engine(dict(src["engine"])), "new_rank": True}


@dataclass(frozen=True)
class Position:
    """Where the new world resumes: its step counter and how many updates its schedule has seen."""

    step: int
    scheduler_steps: int


def remap_position(*, epoch: int, batches_per_epoch: int, batches_left: int, old_step: int,
                   old_scheduler_steps: int) -> Position:
    """The new world's step at (``epoch``, with ``batches_left`` of its batches to go) and the
    schedule's count, keeping the old run's gap between steps and applied updates (pipeline fill
    and skipped steps)."""
    step = epoch * batches_per_epoch + (batches_per_epoch - batches_left)
    return Position(step, max(0, step - (old_step - old_scheduler_steps)))


def accounting(*, epoch: int, consumed: int, dataset: int, old_world: int, new_world: int, batch_size: int,
               batches_left: int) -> dict:
    """The sample accounting of a re-sharded epoch, for the log and summary.json."""
    trained_after = batches_left * batch_size * new_world
    return {"epoch": epoch, "old_world": old_world, "new_world": new_world, "samples_before": consumed,
            "samples_after": trained_after, "dropped": dataset - consumed - trained_after,
            "batches_left_per_rank": batches_left}
