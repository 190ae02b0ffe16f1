"""Kept for ``from pipesgd.pipeline import PipeSGD``: the engine lives in :mod:`pipesgd.engine.pipe`."""

from .engine.base import NonFiniteGradient, NonFinitePolicy, ReductionError, StepStats
from .engine.pipe import PipeSGD

__all__ = ["NonFiniteGradient", "NonFinitePolicy", "PipeSGD", "ReductionError", "StepStats"]
