"""The loop: steps, evaluation, metrics, progress. No communication or compression code here:
the engine decides when gradients move, the trainer only calls ``engine.step()``."""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .metrics import MetricWriter

log = logging.getLogger(__name__)


@dataclass
class History:
    """Per-step timings (ms) and bytes of this rank, kept for medians in summary.json."""

    iter_ms: list[float] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    exposed_comm_ms: list[float] = field(default_factory=list)
    comm_ms: list[float] = field(default_factory=list)
    update_ms: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class Trainer:
    def __init__(self, model: nn.Module, engine, optimizer: torch.optim.Optimizer, scheduler,
                 train_loader, eval_loader, writer: MetricWriter, *, epochs: int,
                 max_steps: int | None, log_every: int, device: torch.device, is_main: bool):
        self.model, self.engine, self.optimizer, self.scheduler = model, engine, optimizer, scheduler
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.writer = writer
        self.epochs, self.log_every, self.device = epochs, log_every, device
        per_epoch = len(train_loader)
        self.total_steps = min(epochs * per_epoch, max_steps) if max_steps else epochs * per_epoch
        self.is_main = is_main
        self.history = History()
        self.step = 0
        self.last_losses: list[float] = []

    def fit(self) -> dict:
        """Train to ``total_steps``; evaluate after every epoch and at the end. Returns metrics."""
        start = time.perf_counter()
        log.info("training %d steps (%d per epoch) on %s", self.total_steps, len(self.train_loader), self.device)
        epoch = 0
        while self.step < self.total_steps:
            self._train_epoch(epoch, start)
            epoch += 1
            if self.step < self.total_steps:
                self._evaluate(epoch, start)
        self.engine.flush()
        result = self._evaluate(epoch, start)
        result["epochs"] = epoch
        result["wall_seconds"] = time.perf_counter() - start
        return result

    def _train_epoch(self, epoch: int, start: float) -> None:
        self.model.train()
        self.train_loader.set_epoch(epoch)
        h = self.history
        t_prev = time.perf_counter()
        for x, y in self.train_loader:
            if self.step >= self.total_steps:
                break
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            with self.engine.forward_context():  # the weights the staleness rule wants the gradient at
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # CPU-GPU sync point: only so compute time is real
            t1 = time.perf_counter()
            stats = self.engine.step()
            if stats.applied:  # the schedule indexes updates, so fill steps of a pipeline don't advance it
                self.scheduler.step()
            t2 = time.perf_counter()

            loss_value = loss.item()
            self.last_losses = (self.last_losses + [loss_value])[-50:]
            h.iter_ms.append((t2 - t_prev) * 1e3)
            h.compute_ms.append((t1 - t0) * 1e3)
            h.exposed_comm_ms.append(stats.wait_s * 1e3)
            h.comm_ms.append(stats.comm.seconds * 1e3)
            h.update_ms.append(stats.update_s * 1e3)
            h.wire_bytes.append(stats.comm.wire_bytes)
            h.ratio.append(stats.comm.ratio)
            t_prev = t2
            self.step += 1
            self.writer.scalars({
                "train/loss": loss_value,
                "train/lr": self.optimizer.param_groups[0]["lr"],
                "time/iter_ms": h.iter_ms[-1],
                "time/compute_ms": h.compute_ms[-1],
                "time/exposed_comm_ms": h.exposed_comm_ms[-1],
                "time/comm_ms": h.comm_ms[-1] if stats.applied else None,
                "comm/bytes_per_step": stats.comm.wire_bytes if stats.applied else None,
                "comm/compression_ratio": stats.comm.ratio if stats.applied else None,
            }, self.step)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {self.step} (epoch {epoch})")
            if self.step % self.log_every == 0 or self.step == self.total_steps:
                self._progress(epoch, loss_value, start)

    def _progress(self, epoch: int, loss: float, start: float) -> None:
        recent = self.history.iter_ms[-self.log_every:]
        it_ms = statistics.median(recent)
        eta = (self.total_steps - self.step) * it_ms / 1e3
        log.info("epoch %d step %d/%d loss %.4f iter %.1f ms (compute %.1f, exposed comm %.1f) ETA %s",
                 epoch + 1, self.step, self.total_steps, loss, it_ms,
                 statistics.median(self.history.compute_ms[-self.log_every:]),
                 statistics.median(self.history.exposed_comm_ms[-self.log_every:]),
                 _fmt_seconds(eta))

    @torch.no_grad()
    def _evaluate(self, epoch: int, start: float) -> dict:
        """Accuracy over the whole test set: each rank scores its shard, counts are summed."""
        _average_buffers(self.model)
        self.model.eval()
        counts = torch.zeros(3, dtype=torch.float64)
        with self.engine.consistent_weights():  # dga: without this rank's pending local step
            for x, y in self.eval_loader:
                x, y = x.to(self.device), y.to(self.device)
                logits = self.model(x)
                counts[0] += (logits.argmax(1) == y).sum().item()
                counts[1] += y.numel()
                counts[2] += F.cross_entropy(logits, y, reduction="sum").item()
        train_loss = torch.tensor([sum(self.last_losses) / max(1, len(self.last_losses))], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(counts)
            dist.all_reduce(train_loss)
            train_loss /= dist.get_world_size()
        self.model.train()
        acc = counts[0].item() / max(1.0, counts[1].item())
        result = {"test_accuracy": acc, "test_loss": counts[2].item() / max(1.0, counts[1].item()),
                  "final_train_loss": train_loss.item(), "step": self.step,
                  "elapsed_s": time.perf_counter() - start}
        self.history.evals.append({"epoch": epoch, **result})
        self.writer.scalars({"test/accuracy": acc, "test/loss": result["test_loss"]}, self.step)
        log.info("eval after epoch %d (step %d): test accuracy %.2f%%, test loss %.4f",
                 epoch, self.step, 100 * acc, result["test_loss"])
        return result


def _average_buffers(model: nn.Module) -> None:
    """Average float buffers (BatchNorm running statistics) across ranks so every replica
    evaluates the same model; parameters are already identical. Training is unaffected."""
    if not dist.is_initialized():
        return
    for b in model.buffers():
        if b.is_floating_point():
            dist.all_reduce(b)
            b /= dist.get_world_size()


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
