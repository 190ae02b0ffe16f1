"""HOW bytes move. Each algorithm is ``fn(tensor, compressor=None, group=None) -> CommStats``
summing ``tensor`` in place across the group, registered by name with its cost
(:data:`REGISTRY`); importing this package registers every module in it."""

import importlib
import pkgutil
from collections.abc import Callable

from .base import (REGISTRY, CommError, CommStats, CommThread, CompletedHandle, FutureHandle, Handle, check_carries,
                   note, one_line, register)
from .native import native_allreduce
from .ring import ring_allreduce, ring_bytes
from .tree import tree_allreduce

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")


def get_allreduce(name: str) -> Callable[..., CommStats]:
    """The allreduce registered as ``name``; ValueError naming the known ones."""
    return REGISTRY.get(name)


__all__ = [
    "REGISTRY", "CommError", "CommStats", "CommThread", "CompletedHandle", "FutureHandle", "Handle", "check_carries",
    "get_allreduce", "native_allreduce", "note", "one_line", "register", "ring_allreduce", "ring_bytes",
    "tree_allreduce",
]
