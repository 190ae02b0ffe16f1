"""HOW bytes move. Each algorithm is ``fn(tensor, compressor=None, group=None) -> CommStats``
summing ``tensor`` in place across the group, registered by name with its cost
(:data:`REGISTRY`); importing this package registers every module in it."""

import importlib
import pkgutil
from collections.abc import Callable

from .. import teardown  # noqa: F401  (before any process group: see there)
from .base import (REGISTRY, CommError, CommStats, CommThread, CompletedHandle, FutureHandle, Handle, bind,
                   check_carries, declared, note, one_line, register)
from .native import native_allreduce
from .ring import ring_allreduce, ring_bytes
from .tree import tree_allreduce

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")


def get_allreduce(name: str, node_groups: Callable | None = None, **options) -> Callable[..., CommStats]:
    """The allreduce registered as ``name`` (``conf/comm/<name>.yaml`` builds every one through
    here); ValueError naming the known ones. One that declares ``node_groups=True`` is a class,
    built with its ``options`` and the groups ``node_groups(group_size)`` creates (collectively:
    the worker passes :func:`pipesgd.dist.node_groups`, every rank at the same point); without
    ``node_groups`` (the launcher, before any process group exists) it is returned unbuilt."""
    plugin = REGISTRY.get(name)
    if not REGISTRY.facts(name).get("node_groups"):
        if options:
            raise ValueError(f"comm={name} takes no options, got {', '.join(f'comm.{k}' for k in options)}")
        return plugin
    if node_groups is None:
        return plugin
    groups = node_groups(options.get("group_size"))
    return plugin(intra=groups.intra, leaders=groups.leaders, **options)


__all__ = [
    "REGISTRY", "CommError", "CommStats", "CommThread", "CompletedHandle", "FutureHandle", "Handle", "bind",
    "check_carries", "declared",
    "get_allreduce", "native_allreduce", "note", "one_line", "register", "ring_allreduce", "ring_bytes",
    "tree_allreduce",
]
