"""Compressors: pure tensor -> payload functions. One module each; importing this package
registers every module in it, so adding a compressor is one .py here plus one conf/compressor yaml.
"""

import importlib
import pkgutil

from .base import REGISTRY, Compressor, Ctx, available, get_compressor, register

for _name in ["none", *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "none"))]:
    importlib.import_module(f"{__name__}.{_name}")  # "none" first: the baseline leads every listing

__all__ = ["REGISTRY", "Compressor", "Ctx", "available", "get_compressor", "register"]
