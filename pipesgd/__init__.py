"""pipesgd: pipelined, compressed data-parallel SGD for PyTorch (Pipe-SGD, Li et al. 2018)."""

from .comm import native_allreduce, ring_allreduce
from .compress import Compressor, get_compressor
from .engine import Engine, NonFiniteGradient, PipeSGD, ReductionError, StepStats

__version__ = "0.1.0"
__all__ = ["Compressor", "Engine", "NonFiniteGradient", "PipeSGD", "ReductionError", "StepStats", "get_compressor",
           "native_allreduce", "ring_allreduce"]
