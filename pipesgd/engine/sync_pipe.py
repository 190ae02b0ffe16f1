"""``trainer.mode=sync`` and ``pipe``: the width-K engine, PipeSGD (:mod:`pipesgd.engine.pipe`); at
``trainer.sync_every`` > 1 the same schedule one level up, PipeDiLoCo (:mod:`pipesgd.engine.diloco`)."""

from __future__ import annotations

import torch

from ..modes import register
from .base import Engine, ModeArgs
from .diloco import PipeDiLoCo
from .pipe import PipeSGD


# Decorators apply bottom-up: sync registers first, the order every listing shows.
@register("pipe", width=None, staleness=True, reductions=True, allreduce=True, sync_every=True, sync_delay=True,
          replicas=True)
@register("sync", width=1, staleness=True, reductions=True, allreduce=True, sync_every=True, reference=True,
          replicas=True)
def build(a: ModeArgs) -> tuple[torch.nn.Module, Engine]:
    """PipeSGD; at ``sync_every`` > 1 the same schedule one level up (:mod:`pipesgd.engine.diloco`)."""
    if a.sync_every > 1:
        return a.model, PipeDiLoCo(a.optimizer, a.model.parameters(), a.sync_every, width=a.width,
                                   outer_optimizer=a.outer_optimizer, staleness=a.staleness,
                                   compressor=a.compressor, allreduce=a.allreduce, group=a.group,
                                   nonfinite=a.nonfinite, timeout_s=a.timeout_s, fragments=a.fragments,
                                   sync_delay=a.sync_delay, warmup_sync_steps=a.warmup_sync_steps,
                                   landing_alpha=a.landing_alpha, fragment_layout=a.fragment_layout,
                                   module=a.model if a.fragment_layout != "contiguous" else None,
                                   replicas=a.replicas)
    return a.model, PipeSGD(a.optimizer, a.model.parameters(), width=a.width, compressor=a.compressor,
                            allreduce=a.allreduce, group=a.group, warmup_sync_steps=a.warmup_sync_steps,
                            staleness=a.staleness, nonfinite=a.nonfinite, timeout_s=a.timeout_s)
