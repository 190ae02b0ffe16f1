"""Compressors: pure tensor -> payload functions. One module each; importing this package
registers every module in it, so adding a compressor is one .py here plus one conf/compressor yaml.
"""

import importlib
import pkgutil

from .base import Compressor, Ctx, available, get_compressor, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Compressor", "Ctx", "available", "get_compressor", "register"]
