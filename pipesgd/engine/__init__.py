"""The engines behind one contract (:class:`Engine`), one module each; a module registers the
builder of each mode it serves (``@register`` of :mod:`pipesgd.modes`): ``sync_pipe.py`` (sync, pipe:
``pipe.py``'s PipeSGD, ``diloco.py``'s PipeDiLoCo at trainer.sync_every > 1), ``ddp.py``,
``local.py``, ``ps.py`` (ps_sync, ps_async). Importing this package imports every module in it, so
adding a mode is one engine module here (and its docs/modes.md row). The torchft wing's two modes,
live (``live/engine.py``) and torchft's own DiLoCo (``live/diloco.py``, torchft_diloco), register
from :mod:`pipesgd.live`, which builds on these engines: reading the mode registry imports them
(:data:`pipesgd.registry.WINGS`), never this package."""

import importlib
import pkgutil

from ..modes import REGISTRY
from .base import Engine, ModeArgs, NonFiniteGradient, NonFinitePolicy, ReductionError, StepStats
from .pipe import PipeSGD
from .sync_pipe import build as _sync_pipe  # noqa: F401  (sync and pipe register first, as modes() lists them)

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

from .diloco import PipeDiLoCo  # noqa: E402
from .direct import DirectEngine  # noqa: E402
from .ps import ParameterServerEngine  # noqa: E402

__all__ = ["REGISTRY", "DirectEngine", "Engine", "ModeArgs", "NonFiniteGradient", "NonFinitePolicy",
           "ParameterServerEngine", "PipeDiLoCo", "PipeSGD", "ReductionError", "StepStats"]
