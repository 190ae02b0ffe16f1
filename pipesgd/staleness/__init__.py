"""Staleness rules (the ``staleness`` config group): one module each, registered by name. Importing
this package imports every module in it, so adding a rule is one .py here plus its
conf/staleness/<name>.yaml (``_target_`` and the constructor's options)."""

import importlib
import pkgutil

from .base import REGISTRY, Staleness, available, make_staleness, register, rule_class, rules_besides

for _name in ["none", *sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "none"))]:
    importlib.import_module(f"{__name__}.{_name}")  # "none" first: the default leads every listing

__all__ = ["REGISTRY", "Staleness", "available", "make_staleness", "register", "rule_class", "rules_besides"]
