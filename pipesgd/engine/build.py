"""A mode's engine: the builder registered as ``trainer.mode`` (:mod:`pipesgd.modes`), given the
composition root's :class:`~pipesgd.engine.base.ModeArgs`, checked to return the Engine it promised."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..modes import builder, get_mode
from .base import Engine, ModeArgs


def build(name: str, args: ModeArgs) -> tuple[nn.Module, Engine]:
    """``(model, engine)`` for ``trainer.mode=name``; ``args.width`` is replaced by the mode's own
    width when it has one, unless it is one of the mode's ``widths`` (ddp at 2: the pipelined hook).
    ``args.compressor`` is one :func:`pipesgd.modes.check_compressor` accepted for the mode (the
    launcher checks it before any worker starts)."""
    width = get_mode(name).runs_at(args.width)
    model, engine = builder(name)(replace(args, width=width))
    if not isinstance(engine, Engine):
        raise TypeError(f"trainer.mode={name}'s builder built a {type(engine).__name__}, not a pipesgd Engine")
    if engine.width != width:
        raise TypeError(f"trainer.mode={name}'s builder built an engine of width {engine.width}; it runs at {width}")
    return model, engine
