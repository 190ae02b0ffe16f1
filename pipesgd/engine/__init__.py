"""The engines, one per module, behind one contract (:class:`Engine`): ``pipe.py`` (sync, pipe),
``direct.py`` with ``ddp.py`` and ``local.py``, ``ps.py`` (ps_sync, ps_async). ``pipesgd.modes``
says which mode builds which."""

from .base import Engine, ModeArgs, NonFiniteGradient, NonFinitePolicy, ReductionError, StepStats
from .direct import DirectEngine
from .pipe import PipeSGD
from .ps import ParameterServerEngine

__all__ = ["DirectEngine", "Engine", "ModeArgs", "NonFiniteGradient", "NonFinitePolicy", "ParameterServerEngine",
           "PipeSGD", "ReductionError", "StepStats"]
