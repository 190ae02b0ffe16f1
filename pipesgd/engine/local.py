"""``trainer.mode=local``: no gradient exchange; every rank steps its own replica on its own shard.
Not training a shared model: the compute-only baseline a benchmark compares the other modes against."""

from __future__ import annotations

from torch import nn

from ..modes import register
from .base import ModeArgs
from .direct import DirectEngine


@register("local", compressors=("none",), overlap="none", replicas_agree=False)
def build(a: ModeArgs) -> tuple[nn.Module, DirectEngine]:
    return a.model, DirectEngine(a.optimizer, 0, 4, 1, a.nonfinite)
