"""HOW bytes move. Each algorithm is ``fn(tensor, compressor=None, group=None) -> CommStats``
summing ``tensor`` in place across the group; ``ALLREDUCE`` maps config names to them."""

from collections.abc import Callable

from .base import CommError, CommStats, CommThread, CompletedHandle, FutureHandle, Handle, note, one_line
from .native import native_allreduce
from .ring import ring_allreduce, ring_bytes
from .tree import tree_allreduce

ALLREDUCE: dict[str, Callable[..., CommStats]] = {
    "ring": ring_allreduce,
    "native": native_allreduce,
    "tree": tree_allreduce,
}


def get_allreduce(name: str) -> Callable[..., CommStats]:
    if name not in ALLREDUCE:
        raise ValueError(f"allreduce={name!r} is not known; allowed: {', '.join(sorted(ALLREDUCE))}")
    return ALLREDUCE[name]


__all__ = [
    "ALLREDUCE", "CommError", "CommStats", "CommThread", "CompletedHandle", "FutureHandle", "Handle",
    "get_allreduce", "native_allreduce", "note", "one_line", "ring_allreduce", "ring_bytes", "tree_allreduce",
]
