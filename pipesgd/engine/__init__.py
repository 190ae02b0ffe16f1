"""The engines behind one contract (:class:`Engine`), one module each; a module registers the
builder of each mode it serves (``@register`` of :mod:`pipesgd.modes`): ``sync_pipe.py`` (sync, pipe:
``pipe.py``'s PipeSGD, ``diloco.py``'s PipeDiLoCo at trainer.sync_every > 1), ``ddp.py``,
``local.py``, ``ps.py`` (ps_sync, ps_async), and the torchft wing's two, which live in :mod:`pipesgd.live`:
the live mode's (``live/engine.py``) and torchft's own DiLoCo (``live/diloco.py``, torchft_diloco). Importing this package imports every
module in it and that one, so adding a mode is one engine module here (and its docs/modes.md row)."""

import importlib
import pkgutil

from ..modes import REGISTRY
from .base import Engine, ModeArgs, NonFiniteGradient, NonFinitePolicy, ReductionError, StepStats
from .pipe import PipeSGD
from .sync_pipe import build as _sync_pipe  # noqa: F401  (sync and pipe first: the paper's modes lead every listing)

# live/engine.py takes the place live.py had here, so the modes keep their order in every listing
# (it imports torchft only when called)
for _name in sorted([m.name for m in pkgutil.iter_modules(__path__)] + ["live"]):
    importlib.import_module("pipesgd.live.engine" if _name == "live" else f"{__name__}.{_name}")
importlib.import_module("pipesgd.live.diloco")  # torchft's own DiLoCo, the period-H engine's peer, after the rest

from .diloco import PipeDiLoCo  # noqa: E402
from .direct import DirectEngine  # noqa: E402
from .ps import ParameterServerEngine  # noqa: E402

__all__ = ["REGISTRY", "DirectEngine", "Engine", "ModeArgs", "NonFiniteGradient", "NonFinitePolicy",
           "ParameterServerEngine", "PipeDiLoCo", "PipeSGD", "ReductionError", "StepStats"]
