"""pipesgd: pipelined, compressed data-parallel SGD for PyTorch (Pipe-SGD, Li et al. 2018).

The names below are imported on first use, so ``import pipesgd.modes`` (the mode registry) needs no torch."""

from importlib import import_module

__version__ = "0.1.0"
_WHERE = {"native_allreduce": "comm", "ring_allreduce": "comm", "Compressor": "compress", "get_compressor": "compress",
          "Engine": "engine", "NonFiniteGradient": "engine", "PipeDiLoCo": "engine", "PipeSGD": "engine",
          "ReductionError": "engine", "StepStats": "engine"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pipesgd' has no attribute {name!r}")
    return vars(import_module(f"{__name__}.{_WHERE[name]}"))[name]
