"""``staleness=delayed_nesterov``: eager's outer step with a delay-aware outer momentum. Only for
``trainer.sync_every > 1`` at width 2, with an SGD outer optimizer (docs/period-h.md).

Eager (:mod:`pipesgd.staleness.eager`) steps the outer optimizer with

    Δ̃_t^m = Δ̄_{t-1} + (Δ_t^m - Δ_{t-1}^m) / M

so its momentum hears this replica's own fresh part Δ_t^m / M one round and its correction
-Δ_{t-1}^m / M the next: a term that cancels in the anchor keeps ringing in the momentum, which is
how eager with the papers' Nesterov outer step ends +20 to +42 % over sync on the GPT recipe. Here
the momentum is updated only from averages that have arrived, as in the delayed Nesterov update
of asynchronous Local-SGD (Liu et al., 2024: momentum on the global weights is the hurdle when the
pseudo-gradients are stale), and the part that stands in for what has not arrived is a plain step
of the outer learning rate η:

    A^m ← Outer(A^m, Δ̄_{t-1})  -  η · (Δ_t^m - Δ_{t-1}^m) / M

With a plain outer step (no momentum) it is eager, bit for bit up to float rounding; the anchors of
the replicas differ by the own term as under eager (their momentum buffers agree).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import register
from .eager import Eager


@register("delayed_nesterov")
class DelayedNesterov(Eager):
    """Eager with the outer momentum fed arrived averages only (the module docstring)."""

    optimizers = (torch.optim.SGD,)

    def _eager(self, late: Tensor, prev: Tensor | None) -> None:
        fresh = self._own[-1] if self._own else None
        self.step_optimizer(late)  # momentum, Nesterov and η on the arrived average alone
        if prev is None and fresh is None:
            return
        correction = torch.zeros_like(late) if fresh is None else fresh.clone()
        if prev is not None:
            correction.sub_(prev)
        lr = {id(p): group["lr"] for group in self.optimizer.param_groups for p in group["params"]}
        with torch.no_grad():
            at = 0
            for p in self.params:
                n = p.numel()
                p.sub_(correction[at:at + n].view_as(p), alpha=lr[id(p)] / self.replicas)
                at += n
