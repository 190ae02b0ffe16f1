"""The trainer's reliability hooks: checkpoint and resume, replica checks, hang context, faults.

docs/reliability.md says what a checkpoint holds (shared state from rank 0, per-rank state
gathered to it) and why in-flight reductions are saved, not drained. Every collective here runs on
the default process group from the main thread; the engine's reductions own the other group.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import elastic, termination
from .checkpoint import (FORMAT, CheckpointDir, CheckpointError, config_diff, config_digest, hashed_config,
                         param_checksum, rng_state, set_rng_state)
from ..data.loader import mix_seed
from ..engine.base import Engine
from ..flat import state_to_device
from .faults import Faults
from ..models import unwrap
from ..modes import get_mode, modes_with
from ..engine.replicas import ReplicaMismatch, describe_mismatch
from ..schedule import reposition
from ..trainer import Trainer, TrainerHooks
from .watchdog import Watchdog, is_comm_failure

log = logging.getLogger(__name__)


class Reliability(TrainerHooks):
    """Checkpoints every ``checkpoint_every`` steps and at each epoch end (None: never), keeping
    ``keep`` in ``<run_dir>/checkpoints``; ``resume`` is ``auto`` (the newest valid checkpoint
    there), ``never`` or a checkpoint path; the replicas' parameter checksums are compared every
    ``check_every`` steps (None: never). ``config`` is the resolved config as plain containers.
    ``watchdog`` (default: no heartbeats) records where this rank is, its heartbeat runs from
    ``on_fit_start`` until :meth:`guard` exits; ``faults`` (default: none; the tests'
    injection, faults.py) are fired after backward.
    ``elastic`` lets a checkpoint written by another number of ranks resume here
    (:mod:`pipesgd.reliability.elastic` says what happens to each piece of state); without it that is an error.
    ``ranks_per_replica`` > 1: the ranks of each replica (consecutive) are also checked to hold the
    same weights, mid-round included; ``replicas_agree`` False: only that (the rule lets replicas differ).
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, engine: Engine, rank: int, world_size: int, device: torch.device, run_dir: str | Path,
                 config: dict, checkpoint_every: int | None = None, keep: int = 2, resume: str = "auto",
                 check_every: int | None = None, watchdog: Watchdog | None = None, faults: Faults | None = None,
                 elastic: bool = False, mode: str = "pipe", replicas_agree: bool = True, ranks_per_replica: int = 1):
        self.module = unwrap(model)
        self.optimizer, self.scheduler, self.engine = optimizer, scheduler, engine
        self.rank, self.world_size, self.device = rank, world_size, device
        self.checkpoints = CheckpointDir(Path(run_dir) / "checkpoints", keep)
        self.checkpoint_every, self.check_every, self.resume = checkpoint_every, check_every, resume
        self.config = hashed_config(config)
        self.digest = config_digest(config)
        self.watchdog = watchdog or Watchdog(rank, world_size, timeout_s=300.0)
        self.faults = faults
        self.resumed_from: int | None = None
        self.elastic, self.mode = elastic, mode
        self.replicas_agree, self.ranks_per_replica = replicas_agree, ranks_per_replica
        self.resharded: dict | None = None

    # ---- hooks ----

    def on_fit_start(self, trainer: Trainer) -> tuple[int, int]:
        self.watchdog.start()
        self.watchdog.set("resume (rank 0 reads the checkpoint and broadcasts it)", trainer.step)
        state = self._load_for_resume()
        epoch, consumed = 0, 0
        if state is not None:
            epoch, consumed = self._restore(state, trainer)
        self.watchdog.set("compute", trainer.step + 1)
        return epoch, consumed

    def on_backward_end(self, trainer: Trainer) -> None:
        if self.faults is not None:  # the tests' fault injection, installed only when PIPESGD_FAULT names this rank
            self.faults.after_backward(trainer.step + 1, trainer.model)
        self.watchdog.set("engine step (launch, wait for and apply reductions)")

    def on_step_end(self, trainer: Trainer, epoch: int, consumed: int) -> None:
        step = trainer.step
        if self.check_every and step % self.check_every == 0:
            self.check_replicas(step)
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self.save(trainer, epoch, consumed)
        self.watchdog.set("compute", step + 1)

    def on_eval_start(self, trainer: Trainer) -> None:
        self.watchdog.set("eval (all_reduce of buffers and counts)")

    def on_epoch_end(self, trainer: Trainer, next_epoch: int) -> None:
        if self.checkpoint_every:
            self.save(trainer, next_epoch, 0)
        self.watchdog.set("compute", trainer.step + 1)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run the loop; a timeout or lost peer becomes a :class:`~pipesgd.reliability.watchdog.HangError`
        naming this rank's step and phase, what it waited on, and the silent peers. A SIGTERM
        (scancel, a scheduler's time limit) ends the process at once, saying where it stood and
        which checkpoint a rerun with the same run directory resumes from."""
        try:
            with termination.reported(self._describe_termination):
                yield
        except Exception as e:
            if is_comm_failure(e):
                raise self.watchdog.explain(e) from e
            raise
        finally:
            self.watchdog.close()

    def _describe_termination(self, sig: signal.Signals) -> str:
        newest = self.checkpoints.list()
        resume = (f"The newest checkpoint is {newest[0]}: run the job again with the same run directory "
                  f"(trainer.resume=auto) to resume from it." if newest else
                  "No checkpoint was written yet: a rerun starts from step 0.")
        return (f"rank {self.rank}: {sig.name} at step {self.watchdog.step} ({self.watchdog.phase}): the job was "
                f"stopped from outside (scancel, a scheduler's time limit or preemption, or the launcher after "
                f"another worker failed); exiting with status {128 + sig}. {resume}")

    def summary(self) -> dict:
        """Fields for summary.json."""
        policy = self.engine.nonfinite
        return {"param_checksum": param_checksum(self.module), "resumed_from_step": self.resumed_from,
                "resharded": self.resharded,
                "nonfinite_skipped_steps": list(policy.skipped) if policy is not None else []}

    # ---- replica check ----

    def check_replicas(self, step: int) -> None:
        """All-gather every rank's parameter sha256 (32 bytes each) on the default group; raise
        :class:`ReplicaMismatch` on every rank if they differ."""
        if self.world_size == 1:
            return
        self.watchdog.set("replica check (all_gather of parameter checksums)")
        # The weights every replica must agree on (staleness=dga keeps pending local steps on top).
        with self.engine.consistent_weights():
            digest = param_checksum(self.module)
        k = self.ranks_per_replica
        if k > 1:  # and this rank's own weights (mid-round), which its replica's ranks share
            digest += param_checksum(self.module)
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.engine.collective(lambda: dist.all_gather(out, mine), "replica check (all_gather of parameter checksums)")
        digests = [bytes(t.cpu().tolist()).hex() for t in out]
        problem = describe_mismatch([d[:64] for d in digests], step) if self.replicas_agree else None
        for first in range(0, self.world_size, k) if k > 1 and not problem else ():
            if len(set(digests[first:first + k])) > 1:
                problem = (f"replica {first // k} diverged at step {step}: its ranks {first}-{first + k - 1} hold "
                           "different weights (sha256 of anchor and weights: " +
                           ", ".join(f"rank {first + i}: {d[:12]}/{d[64:76]}" for i, d in enumerate(digests[first:first + k]))
                           + ")")
                break
        if problem:
            raise ReplicaMismatch(problem + " (trainer.check_every found it; pipesgd applies identical updates on "
                                  "every rank, so this is memory corruption, a bug or non-deterministic hardware)")

    # ---- checkpoint ----

    def save(self, trainer: Trainer, epoch: int, consumed: int) -> None:
        """Collective: every rank contributes its own state, rank 0 writes the checkpoint.
        ``consumed``: samples of ``epoch``'s permutation all ranks together have trained."""
        self.watchdog.set("checkpoint (gather of every rank's state to rank 0)")
        t0 = time.perf_counter()
        # On the CPU before the gather: rank 0 would otherwise unpickle rank k's tensors onto cuda:k.
        engine = state_to_device(self.engine.state_dict(), "cpu")  # waits for in-flight reductions on every rank alike
        shared = {k: engine.pop(k) for k in self.engine.shared_state if k in engine}
        mine = {"rng": rng_state(self.device), "engine": engine,
                "buffers": {k: b.detach().cpu().clone() for k, b in self.module.named_buffers()},
                "losses": list(trainer.last_losses)}
        ranks = self._gather(mine)
        if self.rank != 0:
            return
        state = {
            "format": FORMAT, "step": trainer.step, "epoch": epoch, "consumed": consumed,
            "batch_size": trainer.train_loader.batch_size,
            "world_size": self.world_size, "config_digest": self.digest, "config": self.config,
            "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "engine": shared, "ranks": ranks,
            "evals": list(trainer.history.evals),
        }
        path = self.checkpoints.save(state, trainer.step)
        log.info("checkpoint %s (step %d, epoch %d sample %d) in %.0f ms", path, trainer.step, epoch + 1, consumed,
                 (time.perf_counter() - t0) * 1e3)

    def _gather(self, mine: dict) -> list[dict]:
        if self.world_size == 1:
            return [mine]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0)
        return out

    def _load_for_resume(self) -> dict | None:
        """Rank 0 finds and verifies the checkpoint and broadcasts it; every rank gets the same
        state, or None, or raises the same CheckpointError."""
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = self._find()
            except CheckpointError as e:
                box[0] = e
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], CheckpointError):
            raise box[0]
        return box[0]

    def _find(self) -> dict | None:
        if self.resume == "never":
            return None
        if self.resume == "auto":
            self.checkpoints.remove_temporaries()  # no writer is running before training starts
            found = self.checkpoints.newest_valid()
            if found is None:
                return None
            path, state = found
        else:
            path, state = Path(self.resume), CheckpointDir.load(self.resume, require_checksum=False)
        if state["world_size"] != self.world_size and not self.elastic:
            raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has "
                                  f"{self.world_size}: run with {state['world_size']} workers, set "
                                  "trainer.elastic=true to re-shard the data and per-rank state onto this world "
                                  "(docs/reliability.md), or set trainer.resume=never")
        if state["world_size"] != self.world_size and not get_mode(self.mode).elastic:
            raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has "
                                  f"{self.world_size}: trainer.mode={self.mode} cannot resume on another world size "
                                  f"(elastic modes: {', '.join(modes_with('elastic'))})")
        # hashed again under today's rules, not its stored digest: a checkpoint written before a
        # rule dropped a key (another mode's section) still resumes
        stored = hashed_config(state["config"])
        if stored != self.config:
            diff = "; ".join(config_diff(stored, self.config)) or "(keys differ)"
            if self.resume == "auto":
                raise CheckpointError(f"checkpoint {path} belongs to a run with another config ({diff}); use a new "
                                      "run dir, set trainer.resume=never to start over, or trainer.resume=PATH to "
                                      "continue from it anyway")
            log.warning("resuming from %s although its config differs: %s", path, diff)
        log.info("resuming from %s: step %d, epoch %d", path, state["step"], state["epoch"] + 1)
        return state

    def _restore(self, state: dict, trainer: Trainer) -> tuple[int, int]:
        """Load ``state`` into the model, optimizer, scheduler, engine and trainer; returns the data
        position (epoch, samples of it trained). On another world size, :mod:`pipesgd.reliability.elastic`'s rules."""
        old_world, consumed = state["world_size"], state["consumed"]
        mine = elastic.rank_state(state["ranks"], self.rank, self.engine.state_for_new_rank)
        new_lrs = [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups]
        try:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(dict(state["scheduler"]))
            self.engine.load_state_dict({**mine["engine"], **state["engine"]})
            buffers = dict(self.module.named_buffers())
            for name, value in mine["buffers"].items():
                buffers[name].copy_(value)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"checkpoint of step {state['step']} does not fit this model/optimizer/engine: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from e
        set_rng_state(mine["rng"], self.device)
        if mine.get("new_rank"):
            torch.manual_seed(mix_seed(state["step"], self.rank))  # not the donor's stream
        trainer.last_losses = list(mine["losses"])
        trainer.history.evals = list(state["evals"])  # the accuracy curve so far
        trainer.step = state["step"]
        self.resumed_from = state["step"]
        if old_world != self.world_size:
            self._reshard(state, trainer, consumed, new_lrs)
        return state["epoch"], consumed

    def _reshard(self, state: dict, trainer: Trainer, consumed: int, new_lrs: list[float]) -> None:
        """The step counter, schedule and learning rate of the new world at the same point of training."""
        loader, epoch, old_world = trainer.train_loader, state["epoch"], state["world_size"]
        left = loader.batches_left(consumed)
        pos = elastic.remap_position(epoch=epoch, batches_per_epoch=len(loader), batches_left=left,
                                     old_step=state["step"], old_scheduler_steps=self.scheduler.last_epoch)
        old_lrs = list(self.scheduler.base_lrs)
        reposition(self.scheduler, new_lrs, pos.scheduler_steps)
        trainer.step = pos.step
        self.resharded = elastic.accounting(epoch=epoch, consumed=consumed, dataset=len(loader.split),
                                            old_world=old_world, new_world=self.world_size,
                                            batch_size=loader.batch_size, batches_left=left)
        self.resharded |= {"old_step": state["step"], "new_step": pos.step, "old_lr": old_lrs[0], "new_lr": new_lrs[0]}
        log.warning("elastic resume: world %d -> %d ranks; global batch %d -> %d, base lr %.4g -> %.4g; step %d -> %d "
                    "(same point of epoch %d); epoch %d: %d samples trained before, %d left over %d ranks "
                    "(%d batches each), %d dropped (the last partial global batch)", old_world, self.world_size,
                    loader.batch_size * old_world, loader.batch_size * self.world_size, old_lrs[0], new_lrs[0],
                    state["step"], pos.step, epoch + 1, epoch + 1, consumed, self.resharded["samples_after"],
                    self.world_size, left, self.resharded["dropped"])
