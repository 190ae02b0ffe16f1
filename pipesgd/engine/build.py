"""A mode's engine from its row of :mod:`pipesgd.modes`: the builder the row names, given the
composition root's :class:`~pipesgd.engine.base.ModeArgs`, checked to return the Engine it promised."""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module

from torch import nn

from ..modes import check_compressor, get_mode
from .base import Engine, ModeArgs


def build(name: str, args: ModeArgs) -> tuple[nn.Module, Engine]:
    """``(model, engine)`` for ``trainer.mode=name``; ``args.width`` is replaced by the mode's own
    width when it has one, unless it is one of the row's ``widths`` (ddp at 2: the pipelined hook). Raises ValueError for a compressor the mode does not carry."""
    mode = get_mode(name)
    check_compressor(name, args.compressor)
    module, function = mode.engine.split(":")
    width = mode.runs_at(args.width)
    model, engine = getattr(import_module(module), function)(replace(args, width=width))
    if not isinstance(engine, Engine):
        raise TypeError(f"{mode.engine} built a {type(engine).__name__}, not a pipesgd Engine")
    if engine.width != width:
        raise TypeError(f"{mode.engine} built an engine of width {engine.width}; trainer.mode={name} runs at {width}")
    return model, engine
