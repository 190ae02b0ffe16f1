"""Learning-rate schedules as per-step multipliers (``LambdaLR``), built from step counts the
trainer knows. Each factory is ``f(optimizer, total_steps, steps_per_epoch) -> LRScheduler``;
config provides the rest as a ``_partial_``."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _check_nonneg(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"scheduler.{name} must be >= 0, got {value}")


def _warmup_length(warmup_epochs: float, warmup_steps: int | None, steps_per_epoch: int) -> int:
    """Warm-up updates: ``warmup_steps`` when given (then ``warmup_epochs`` must be 0), else
    ``warmup_epochs`` of ``steps_per_epoch``."""
    _check_nonneg("warmup_epochs", warmup_epochs)
    if warmup_steps is None:
        return round(warmup_epochs * steps_per_epoch)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"scheduler.warmup_steps must be an integer >= 0 or null, got {warmup_steps!r}")
    if warmup_epochs:
        raise ValueError(f"scheduler.warmup_steps={warmup_steps} and scheduler.warmup_epochs={warmup_epochs} "
                         f"both set the warm-up; set one (the other to null / 0)")
    return warmup_steps


def constant(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
             warmup_epochs: float = 0.0) -> LambdaLR:
    _check_nonneg("warmup_epochs", warmup_epochs)
    w = round(warmup_epochs * steps_per_epoch)
    return LambdaLR(optimizer, lambda s: _warmup(s, w))


def cosine(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
           warmup_epochs: float = 0.0, min_lr_ratio: float = 0.0, warmup_steps: int | None = None) -> LambdaLR:
    """Linear warm-up (``warmup_epochs``, or ``warmup_steps`` updates), then half a cosine from the
    base lr down to ``min_lr_ratio`` x base at ``total_steps``."""
    w = _warmup_length(warmup_epochs, warmup_steps, steps_per_epoch)

    def f(s: int) -> float:
        if s < w:
            return _warmup(s, w)
        progress = min(1.0, (s - w) / max(1, total_steps - w))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, f)


def multistep(optimizer: Optimizer, total_steps: int, steps_per_epoch: int,
              milestones: list[float] = (0.5, 0.75), gamma: float = 0.1,
              warmup_epochs: float = 0.0) -> LambdaLR:
    """Multiply by ``gamma`` at each milestone, given as a fraction of training (0.5 = halfway)."""
    _check_nonneg("warmup_epochs", warmup_epochs)
    w = round(warmup_epochs * steps_per_epoch)
    marks = sorted(round(m * total_steps) for m in milestones)
    return LambdaLR(optimizer, lambda s: _warmup(s, w) * gamma ** sum(s >= m for m in marks))


def poly(optimizer: Optimizer, total_steps: int, steps_per_epoch: int, power: float = 0.5,
         warmup_epochs: float = 0.0) -> LambdaLR:
    """Polynomial decay to zero, ``(1 - progress) ** power`` (FireCaffe used power 0.5)."""
    _check_nonneg("warmup_epochs", warmup_epochs)
    w = round(warmup_epochs * steps_per_epoch)

    def f(s: int) -> float:
        if s < w:
            return _warmup(s, w)
        return max(0.0, 1 - (s - w) / max(1, total_steps - w)) ** power

    return LambdaLR(optimizer, f)


def reposition(scheduler: LambdaLR, base_lrs: list[float], steps: int) -> None:
    """Put ``scheduler`` (one of this module's LambdaLR schedules) at ``steps`` applied updates with
    new base learning rates, and its optimizer's groups at the matching lr (elastic resume: the new
    world's lr at the same point of training). The one place that reads LambdaLR's internals."""
    scheduler.base_lrs = list(base_lrs)
    scheduler.last_epoch = steps
    for group, base, f in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * f(steps)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
