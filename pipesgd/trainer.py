"""The loop: steps, evaluation, metrics, progress. No communication or compression code here:
the engine decides when gradients move, the trainer only calls ``engine.step()``. Checkpoints,
resume, replica checks and fault injection hang off :class:`TrainerHooks` (pipesgd.reliability.hooks)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .observability import trace
from .comm.streams import Span, clock_for
from .engine.base import Engine, StepStats
from .observability.metrics import MetricWriter
from .objective import Classification, Objective
from .observability.progress import Status, make_progress
from .observability.summary import History, median

log = logging.getLogger(__name__)


@dataclass
class _StepRecord:
    """One step as the loop saw it, with the values that live on the device not read yet."""

    step: int
    epoch: int
    loss: torch.Tensor
    iter_ms: float
    compute: Span
    stats: StepStats
    lr: float
    wall_time: float


def batch_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory, so the copy is asynchronous (from
    pageable memory ``non_blocking=True`` is a staged copy the CPU waits for)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class TrainerHooks:
    """Where the loop calls out; every method is a no-op here. ``on_fit_start`` may restore state
    (including ``trainer.step``) and returns the position to start from: (epoch, samples of its
    permutation all ranks together have trained); ``on_step_end`` gets the position after the
    step; ``on_epoch_end`` runs after the epoch's evaluation with the number of the epoch about
    to start."""

    def on_fit_start(self, trainer: Trainer) -> tuple[int, int]:
        return 0, 0

    def on_backward_end(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer, epoch: int, consumed: int) -> None:
        pass

    def on_eval_start(self, trainer: Trainer) -> None:
        pass

    def on_epoch_end(self, trainer: Trainer, next_epoch: int) -> None:
        pass


class Trainer:
    """``eval_loader``: batches of (inputs, targets); with an engine whose peers share the test set
    among live replica groups, also ``share(index, count)`` (:class:`pipesgd.data.loader.EvalLoader`
    and the text loader have it). ``predict(history) -> ms``, if given, is the timing model's
    iteration time for what the run has measured so far; it is logged next to the measured median
    at every progress point."""

    def __init__(self, model: nn.Module, engine: Engine, optimizer: torch.optim.Optimizer, scheduler,
                 train_loader, eval_loader, writer: MetricWriter, *, epochs: int,
                 max_steps: int | None, log_every: int, device: torch.device, is_main: bool,
                 stop_after_step: int | None = None,
                 predict: Callable[[History], float | None] | None = None,
                 eval_max_batches: int | None = None, eval_every_steps: int | None = None,
                 hooks: TrainerHooks | None = None, objective: Objective | None = None):
        self.model, self.engine, self.optimizer, self.scheduler = model, engine, optimizer, scheduler
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.writer = writer
        self.epochs, self.log_every, self.device = epochs, log_every, device
        self.eval_max_batches, self.eval_every_steps = eval_max_batches, eval_every_steps
        per_epoch = len(train_loader)
        self.total_steps = min(epochs * per_epoch, max_steps) if max_steps else epochs * per_epoch
        # the step this process stops at: the schedule and evaluations still follow total_steps
        self.stop_step = min(self.total_steps, stop_after_step) if stop_after_step else self.total_steps
        self.is_main = is_main
        self.hooks = hooks or TrainerHooks()
        self.objective = objective or Classification()
        self.predict = predict
        self.progress = make_progress(self.total_steps, log_every, is_main)
        self.history = History()
        self.step = 0
        self.clock = clock_for(device)
        # How many steps may stay unread (losses and device times, see _read): every step on the
        # CPU, where a read costs nothing; on a GPU only at log points.
        self.read_every = 1 if device.type == "cpu" else log_every
        self._unread: list[_StepRecord] = []
        self._last_losses: list[float] = []
        self._logged_loss: float | None = None  # the newest train/loss written: the progress line's
        # with an engine that averages the loss: the newest step read, its own loss, until the mean arrives
        self._loss_pending: tuple[_StepRecord, float] | None = None
        self._seek = False  # seek() was called inside this step: the loop moves to its position at the step's end

    def seek(self, step: int) -> None:
        """Continue from ``step`` as if this process had run the steps before it (a live replica
        group healing takes its donor's step, during ``engine.step()``): ``self.step`` is set now,
        and at the end of the step in progress the loop moves to the batch an uninterrupted run
        draws next (:meth:`position`), in this loader's own shard, as a checkpoint resume does.
        Evaluations and epoch ends between the old position and the new one are not run here;
        one due at ``step`` itself is, as its peers run it there (they average buffers and losses
        with it: every group of a quorum must take part)."""
        self.step = step
        self._seek = True

    def position(self, step: int) -> tuple[int, int]:
        """Where the data stands after ``step`` steps of a run that was never resharded: (epoch,
        samples of its permutation all shards together have trained)."""
        loader = self.train_loader
        epoch, batch = divmod(step, len(loader))
        return epoch, batch * loader.batch_size * loader.world_size

    def fit(self) -> dict:
        """Train to ``total_steps``; evaluate after every epoch and at the end. Returns metrics.

        With ``stop_after_step`` the loop ends at that step as an interrupted run would, and the
        run's last evaluation is the result if it was taken at that very step (no flush-then-evaluate:
        a pipeline's in-flight reduction would change the weights the whole run scored)."""
        start = time.perf_counter()
        epoch, consumed = self.hooks.on_fit_start(self)
        log.info("training %d steps (%d per epoch) on %s", self.total_steps, len(self.train_loader), self.device)
        try:
            while self.step < self.stop_step:
                ended = self._train_epoch(epoch, start, consumed)
                if self._seek:  # the step moved under the loop (a heal): so does the data
                    self._seek = False
                    epoch, consumed = self.position(self.step)
                    if consumed == 0 and self.step < self.total_steps:  # it landed on an epoch's end, as its peers
                        self._evaluate(epoch, start)
                        self.hooks.on_epoch_end(self, epoch)
                    continue
                if not ended and self.step < self.total_steps:
                    break  # stopped inside the epoch (stop_after_step)
                epoch, consumed = epoch + 1, 0
                if self.step < self.total_steps:
                    self._evaluate(epoch, start)
                    self.hooks.on_epoch_end(self, epoch)
            flushed = self.engine.flush()
            self._read()
            if self.engine.averages_loss:  # the last step's mean came with the flush
                self._log_averaged_loss(flushed.loss, self.step)
            last = self.history.evals[-1] if self.history.evals else None
            if self.step < self.total_steps and last is not None and last["step"] == self.step:
                result = {k: v for k, v in last.items() if k != "epoch"}
            else:
                result = self._evaluate(epoch, start)
        finally:
            self.progress.close()
        result["epochs"] = epoch
        result["wall_seconds"] = time.perf_counter() - start
        return result

    def _train_epoch(self, epoch: int, start: float, consumed: int = 0) -> bool:
        """The rest of ``epoch`` after ``consumed`` samples (by all ranks) of its permutation; True if
        it ran to the epoch's end."""
        self.model.train()
        self.train_loader.set_epoch(epoch)
        tr = trace.current()
        t_prev = time.perf_counter()
        loader = self.train_loader
        per_step = loader.batch_size * loader.world_size
        left = loader.batches_left(consumed)
        for batch, (x, y) in enumerate(loader.iter_epoch(epoch, 0, consumed), 1):
            if self.step >= self.stop_step:
                return False
            x, y = batch_to_device(x, self.device), batch_to_device(y, self.device)
            mark = self.clock.start()
            self.optimizer.zero_grad(set_to_none=True)
            # forward_context: the weights the staleness rule wants the gradient at, held until
            # backward has used them (autograd saved those very tensors)
            with self.engine.forward_context():
                with tr.span("forward", "compute", self.step):
                    loss = self.objective.loss(self.model(x), y)
                with tr.span("backward", "compute", self.step):
                    loss.backward()
            self.hooks.on_backward_end(self)
            compute = self.clock.stop(mark)  # device time on a GPU: no sync here
            self.engine.carry_loss(loss.detach())
            stats = self.engine.step()
            if stats.applied:  # the schedule indexes updates, so fill steps of a pipeline don't advance it
                self.scheduler.step()
            t2 = time.perf_counter()
            self.step += 1
            # The loss and the device times stay unread until a log point: on a GPU each read is a
            # host sync that stops the CPU from queueing the next step (docs/gpu.md, "How the NCCL path works").
            self._unread.append(_StepRecord(self.step, epoch, loss.detach(), (t2 - t_prev) * 1e3, compute, stats,
                                            self.optimizer.param_groups[0]["lr"], time.time()))
            t_prev = t2
            if len(self._unread) >= self.read_every or self.step % self.log_every == 0 or self.step == self.total_steps:
                self._read()
            if self.step % self.log_every == 0 or self.step == self.total_steps:
                self._log_prediction()
            if self.progress.due(self.step):
                self._read()
                shown = self._logged_loss if self._logged_loss is not None else self._last_losses[-1]
                self.progress.show(self._status(epoch, shown))
            if self._seek:  # engine.step() moved this replica to its group's step: continue from there
                landed, at = self.position(self.step)
                if at and self._eval_due(epoch_ends=False):  # its peers evaluate here, and average with it
                    self._evaluate(landed + at / (len(loader) * per_step), start)
                self.hooks.on_step_end(self, landed, at)
                return False
            # before on_step_end, so a checkpoint taken at this step already holds this evaluation
            if self._eval_due(epoch_ends=batch == left):
                self._evaluate(epoch + (consumed + batch * per_step) / (len(loader) * per_step), start)
            self.hooks.on_step_end(self, epoch, consumed + batch * per_step)
        return True

    def _read(self) -> None:
        """Read the steps not read yet (one host sync for all their losses) into the history, the
        metric writer and the loss window; stop on a non-finite loss when the engine has no policy."""
        records, self._unread = self._unread, []
        if not records:
            return
        losses = torch.stack([r.loss.float() for r in records]).tolist()
        h, averaged = self.history, self.engine.averages_loss
        for r, loss in zip(records, losses):
            stats = r.stats
            self._last_losses = (self._last_losses + [loss])[-50:]
            h.iter_ms.append(r.iter_ms)
            h.compute_ms.append(r.compute.seconds() * 1e3)
            h.exposed_comm_ms.append(stats.exposed_s() * 1e3)
            h.comm_ms.append(stats.comm.time_s() * 1e3)
            h.update_ms.append(stats.update_s * 1e3)
            h.wire_bytes.append(stats.comm.wire_bytes)
            h.ratio.append(stats.comm.ratio)
            h.wall_time.append(r.wall_time)
            # hidden = the reduction's time minus the caller's wait, floored at 0 (at width 1 the
            # wait also covers the hand-off to the thread); DDP times no reduction.
            timed_comm = stats.applied and h.comm_ms[-1] > 0
            self.writer.scalars({
                "train/loss": None if averaged else loss,  # averaged: the step's mean, when it comes
                "train/lr": r.lr,
                "train/staleness": stats.staleness if stats.applied else None,
                "time/iter_ms": h.iter_ms[-1],
                "time/compute_ms": h.compute_ms[-1],
                "time/compute_utilization": h.compute_ms[-1] / h.iter_ms[-1] if h.iter_ms[-1] > 0 else None,
                "time/exposed_comm_ms": h.exposed_comm_ms[-1],
                "time/comm_ms": h.comm_ms[-1] if stats.applied else None,
                "time/hidden_comm_ms": max(0.0, h.comm_ms[-1] - h.exposed_comm_ms[-1]) if timed_comm else None,
                "comm/bytes_per_step": stats.comm.wire_bytes if stats.applied else None,
                "comm/compression_ratio": stats.comm.ratio if stats.applied else None,
                **stats.metrics,
            }, r.step, walltime=r.wall_time)
            if averaged:  # this step's stats carry the mean of the step before (after a heal: the donor's)
                self._log_averaged_loss(r.stats.loss, r.step - 1)
                self._loss_pending = (r, loss)
            else:
                self._logged_loss = loss
            # An engine with a non-finite policy decides on the gradient with every rank together
            # (trainer.nonfinite); without one, this rank stops on its own.
            if not math.isfinite(loss) and self.engine.nonfinite is None:
                raise FloatingPointError(f"loss is {loss} at step {r.step} (epoch {r.epoch})")

    def _log_averaged_loss(self, mean: float | None, step: int) -> None:
        """``train/loss`` of ``step`` from an engine that averages the loss over its replicas
        (:attr:`Engine.averages_loss`): the mean it returned a step late, at that step's wall time;
        where it returned none (the vote dropped the reduction), this replica's own loss. A step
        the loop left by a heal (its loss on weights this replica no longer holds) gets neither."""
        pending, self._loss_pending = self._loss_pending, None
        if pending is not None and pending[0].step != step:  # a heal moved the loop past it
            pending = None
        value = mean if mean is not None else None if pending is None else pending[1]
        if value is not None:
            self.writer.scalars({"train/loss": value}, step, walltime=None if pending is None else pending[0].wall_time)
            self._logged_loss = value

    @property
    def last_losses(self) -> list[float]:
        """The training losses of the last (up to) 50 steps, every step read."""
        self._read()
        return self._last_losses

    @last_losses.setter
    def last_losses(self, value: list[float]) -> None:
        self._read()
        self._last_losses = list(value)

    def _eval_due(self, epoch_ends: bool) -> bool:
        """An in-epoch evaluation every ``eval_every_steps`` steps, except where the epoch's end (or
        the run's) evaluates anyway."""
        every = self.eval_every_steps
        return every is not None and self.step % every == 0 and not epoch_ends and self.step < self.total_steps

    def _status(self, epoch: int, loss: float) -> Status:
        h, n = self.history, self.log_every
        return Status(epoch=epoch + 1, step=self.step, total=self.total_steps, loss=loss,
                      iter_ms=statistics.median(h.iter_ms[-n:]), compute_ms=statistics.median(h.compute_ms[-n:]),
                      exposed_comm_ms=statistics.median(h.exposed_comm_ms[-n:]))

    def _log_prediction(self) -> None:
        """Predicted vs measured median iteration time over the steps so far (cost: one sort)."""
        if self.predict is not None:
            self.writer.scalars({"time/predicted_iter_ms": self.predict(self.history),
                                 "time/measured_iter_ms": median(self.history.iter_ms)}, self.step)

    def _score(self, loader) -> torch.Tensor:
        """The objective's sums over ``loader`` (its first ``eval_max_batches`` batches when set)."""
        # On the model's device: NCCL reduces device tensors only, and the sums stay there until
        # read once at the end (no host sync per batch).
        totals = torch.zeros(self.objective.width, dtype=torch.float64, device=self.device)
        # consistent_weights: dga evaluates without this rank's pending local step
        with trace.current().span("eval", "eval", self.step), self.engine.consistent_weights():
            for i, (x, y) in enumerate(loader):
                if self.eval_max_batches is not None and i >= self.eval_max_batches:
                    break
                x, y = x.to(self.device), y.to(self.device)
                totals += self.objective.sums(self.model(x), y)
        return totals

    @torch.no_grad()
    def _evaluate(self, epoch: float, start: float) -> dict:
        """The objective's metrics over the test set (its first ``eval_max_batches`` batches per rank
        when set): each rank sums its shard, the sums are added (live replica groups: their share of
        the quorum's, :class:`pipesgd.live.peers.QuorumPeers`). ``epoch`` is the epochs
        trained so far (fractional inside an epoch); ``eval_s`` in the result is the evaluation's
        own time; ``averaged_replicas`` how many replicas' buffers and recent losses were averaged
        (``final_train_loss`` is their mean): the world size, or the live groups that took part."""
        t0 = time.perf_counter()
        self.hooks.on_eval_start(self)
        # The loop's collectives go through the engine's peers: on its communication thread
        # (PipeSGD) they keep one order with the reductions in flight on every rank (NCCL needs it);
        # under live recovery they run over the quorum's groups, and a group that dies hangs none.
        peers = self.engine.peers()
        # Float buffers (BatchNorm running statistics) averaged, so every replica evaluates the same
        # model (parameters are already identical; training is unaffected); with them the mean
        # training loss of the replicas' recent steps, and how many replicas the means hold.
        train_loss = torch.tensor([sum(self.last_losses) / max(1, len(self.last_losses))], dtype=torch.float64,
                                  device=self.device)
        replicas = peers.average([b for b in self.model.buffers() if b.is_floating_point()] + [train_loss],
                                 "averaging buffers and losses for evaluation")
        self.model.eval()
        share = peers.evaluation_share()
        totals = self._score(self.eval_loader if share is None else self.eval_loader.share(*share))
        if not peers.sum(totals, "summing the evaluation's scores"):  # a live group lost while scoring:
            index, count = share  # the shares it would have added, scored here
            for other in (o for o in range(count) if o != index):
                totals += self._score(self.eval_loader.share(other, count))
        self.model.train()
        metrics = self.objective.results(totals.cpu())
        result = {**metrics, "final_train_loss": train_loss.item(), "averaged_replicas": replicas, "step": self.step,
                  "elapsed_s": time.perf_counter() - start, "eval_s": time.perf_counter() - t0}
        self.history.evals.append({"epoch": epoch, **result})
        self.writer.scalars({f"test/{k.removeprefix('test_')}": v for k, v in metrics.items()}, self.step)
        log.info("eval after epoch %.4g (step %d): %s", epoch, self.step,
                 ", ".join(f"{k.removeprefix('test_').replace('_', ' ')} "
                           + (f"{100 * v:.2f}%" if k == "test_accuracy" else f"{v:.4f}") for k, v in metrics.items()))
        return result

