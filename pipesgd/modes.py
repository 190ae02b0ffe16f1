"""Training modes: how a model and optimizer become a data-parallel (model, engine) pair.

Every engine has the PipeSGD surface the trainer uses: ``step() -> StepStats``, ``flush()``,
``forward_context()``, ``consistent_weights()``, ``state_dict()``, ``load_state_dict()``,
``close()``, ``width``. ``MODES`` maps ``trainer.mode``
to a builder; adding a mode is one function here (or in its own module) and one entry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from . import ps
from . import trace
from .comm import CommStats
from .comm.ring import chunk_bounds
from .compress import Compressor
from .compress.none import NoCompression
from .pipeline import NonFinitePolicy, PipeSGD, StepStats
from .reduction import Reduction
from .staleness import Staleness


@dataclass
class ModeArgs:
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


class DDPEngine:
    """``optimizer.step()`` behind the engine surface: DDP already averaged the gradients during
    backward, so nothing is in flight between steps. ``comm`` bytes are those of an ideal ring
    for the bucket dtype (DDP does not expose what it sent). The averaged gradients are identical
    on every rank, so checking them for NaN/inf is a collective decision without a flag (DDP does
    not say which rank produced them)."""

    width = 1

    def __init__(self, optimizer: torch.optim.Optimizer, numel: int, wire_elem: int, world_size: int,
                 nonfinite: str = "abort"):
        self.optimizer = optimizer
        sent = 2 * sum(b - a for a, b in chunk_bounds(numel, world_size)[1:]) if world_size > 1 else 0
        self._comm = CommStats(wire_bytes=sent * wire_elem, raw_bytes=sent * 4)
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.steps = 0
        self.last = StepStats()

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        self.steps += 1
        comm = CommStats(self._comm.wire_bytes, self._comm.raw_bytes)
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        # NaN/inf propagate through sums (see Reducer.flatten); one device sync per step.
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

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()

    def consistent_weights(self) -> AbstractContextManager:
        return nullcontext()

    def state_dict(self) -> dict:
        return {"width": 1, "steps": self.steps, "pending": [], "nonfinite": self.nonfinite.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])

    def close(self) -> None:
        pass


def _pipesgd(width: int | None) -> Callable[[ModeArgs], tuple[nn.Module, object]]:
    """PipeSGD at a fixed width, or at ``trainer.width`` when ``width`` is None."""

    def build(a: ModeArgs) -> tuple[nn.Module, object]:
        return a.model, PipeSGD(a.optimizer, a.model.parameters(), width=width or a.width,
                                compressor=a.compressor, allreduce=a.allreduce, group=a.group,
                                warmup_sync_steps=a.warmup_sync_steps, staleness=a.staleness,
                                nonfinite=a.nonfinite, timeout_s=a.timeout_s)

    return build


_DDP_HOOKS = {"none": None, "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def _ddp(a: ModeArgs) -> tuple[nn.Module, object]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    if a.compressor.name not in _DDP_HOOKS:
        raise ValueError(f"trainer.mode=ddp supports compressor={'|'.join(_DDP_HOOKS)} (DDP's own hooks), "
                         f"got {a.compressor.name!r}")
    numel = sum(p.numel() for p in a.model.parameters() if p.requires_grad)
    if a.world_size == 1:
        return a.model, DDPEngine(a.optimizer, numel, 4, 1, a.nonfinite)
    ids = [a.device.index] if a.device.type == "cuda" else None
    model = DDP(a.model, device_ids=ids)
    hook = _DDP_HOOKS[a.compressor.name]
    if hook is not None:
        model.register_comm_hook(None, getattr(default_hooks, hook))
    wire = 4 if isinstance(a.compressor, NoCompression) else 2
    return model, DDPEngine(a.optimizer, numel, wire, a.world_size, a.nonfinite)


def _local(a: ModeArgs) -> tuple[nn.Module, object]:
    """No gradient exchange: every rank steps its own replica on its own shard. Not training a
    shared model; the compute-only baseline a benchmark compares the other modes against."""
    return a.model, DDPEngine(a.optimizer, 0, 4, 1, a.nonfinite)


# Modes whose replicas differ by design (no shared model while training): no replica check.
DIVERGENT_MODES = ("local", "ps_async")

MODES: dict[str, Callable[[ModeArgs], tuple[nn.Module, object]]] = {
    "sync": _pipesgd(1),
    "pipe": _pipesgd(None),
    "ddp": _ddp,
    "ps_sync": ps.build_sync,
    "ps_async": ps.build_async,
    "local": _local,
}


def build(mode: str, args: ModeArgs) -> tuple[nn.Module, object]:
    if mode not in MODES:
        raise ValueError(f"trainer.mode={mode!r} is not known; allowed: {', '.join(MODES)}")
    return MODES[mode](args)
