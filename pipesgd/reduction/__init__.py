"""WHAT one step's flat gradient becomes on the wire: reduction strategies the GradientExchange delegates to.

``compressor=none|fp16|bf16|int8`` are per-chunk encoders carried inside the configured allreduce
(:class:`InRing`); ``compressor=topk|powersgd`` are reductions with collectives of their own. Adding
one is a module here with ``@register("name")`` and a conf/compressor yaml.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..compress import Compressor, available, get_compressor
from .base import REGISTRY, Reduction, get_reduction, reductions, register
from .inring import InRing
from .memory import ErrorFeedback

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

from .powersgd import PowerSGD  # noqa: E402  (the library's names for two of them)
from .topk import TopK  # noqa: E402

Spec = str | Compressor | Reduction | None


def resolve(spec: Spec) -> Compressor | Reduction:
    """A compressor name, a reduction name (``"topk"``), an instance, or ``None`` (= ``"none"``)."""
    if isinstance(spec, (Compressor, Reduction)):
        return spec
    name = "none" if spec is None else spec
    if name in reductions():
        return get_reduction(name)
    if name not in available():
        raise ValueError(f"compressor={name!r} is not known; allowed: {', '.join(sorted(available() + reductions()))}")
    return get_compressor(name)


def as_reduction(spec: Compressor | Reduction) -> Reduction:
    """The strategy for a resolved spec: an in-ring compressor rides the configured allreduce."""
    return spec if isinstance(spec, Reduction) else InRing(spec)


__all__ = ["REGISTRY", "ErrorFeedback", "InRing", "PowerSGD", "Reduction", "TopK", "as_reduction", "reductions",
           "register", "resolve"]
