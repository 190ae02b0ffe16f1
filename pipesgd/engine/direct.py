"""An engine for gradients that are already what to apply: ``optimizer.step()`` behind the contract
(``trainer.mode=ddp``, whose DDP averaged them during backward, and ``local``, which exchanges none)."""

from __future__ import annotations

import time

import torch

from ..observability import trace
from ..comm import CommStats, ring_bytes
from .base import Engine, NonFinitePolicy, StepStats


class DirectEngine(Engine):
    """Nothing is in flight between steps. ``comm`` bytes are those of an ideal ring of ``numel``
    values at ``wire_elem`` bytes each (DDP does not expose what it sent; 0 for ``numel=0``). The
    gradients are identical on every rank (DDP) or nobody else's business (local), so checking
    them for NaN/inf is a decision every rank reaches alike without a flag."""

    def __init__(self, optimizer: torch.optim.Optimizer, numel: int, wire_elem: int, world_size: int,
                 nonfinite: str = "abort"):
        self.optimizer = optimizer
        self._comm = CommStats(wire_bytes=ring_bytes(numel, world_size, wire_elem),
                               raw_bytes=ring_bytes(numel, world_size, 4))
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.steps = 0
        self.last = StepStats()

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        self.steps += 1
        comm = CommStats(self._comm.wire_bytes, self._comm.raw_bytes)
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        # NaN/inf propagate through sums (see GradientExchange.flatten); one device sync per step.
        if grads and not torch.isfinite(torch.stack([g.float().sum() for g in grads]).sum()).item():
            self.nonfinite.bad(self.steps, "averaged by DDP, which does not say which rank")
            self.last = StepStats(comm=comm, skipped=True)
            return self.last
        self.nonfinite.good()
        with trace.current().span("update", "update", self.steps):
            self.optimizer.step()
        self.last = StepStats(update_s=time.perf_counter() - t0, applied=True, comm=comm)
        return self.last

    def flush(self) -> StepStats:
        return StepStats()

    def state_dict(self) -> dict:
        return {"width": self.width, "steps": self.steps, "pending": [], "nonfinite": self.nonfinite.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])
