"""Staleness rules (``trainer.staleness``): one module each, registered by name. Importing this
package imports every module in it, so adding a rule is one .py here (plus ``trainer.<option>``
fields in pipesgd/schema.py and conf/trainer/default.yaml for the options it takes)."""

import importlib
import pkgutil

from .base import Staleness, available, make_staleness, register

for _name in ["none", *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "none"))]:
    importlib.import_module(f"{__name__}.{_name}")  # "none" first: the default leads every listing

__all__ = ["Staleness", "available", "make_staleness", "register"]
