"""Every plugin kind registers the same way: ``@register("name", **facts)`` on its class or function
(compressors, reductions, allreduces, staleness rules, and the engine builders of the modes). A
plugin is its module plus ``conf/<group>/<name>.yaml`` (a mode: its engine module and its row in
docs/modes.md); no if/elif factory or second list names it.

Each kind says which **facts** a plugin must declare (``Registry(kind, facts=...)``): the things
the rest of the system reads instead of asking what a plugin is. A fact is a keyword of
``register`` or an attribute of the class; registration fails, naming the missing fact, when one
is absent, so an incomplete plugin never reaches a run. This module is the only place that looks
a plugin over (``getattr``/``hasattr``); everyone else reads :meth:`Registry.facts`.
docs/adding-a-plugin.md walks through one plugin of each kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from importlib import import_module
from types import MappingProxyType
from typing import Generic, TypeVar

T = TypeVar("T")

KINDS: dict[str, tuple[str, str]] = {
    "compressor": ("pipesgd.compress", "compressor"),
    "reduction": ("pipesgd.reduction", "compressor"),
    "allreduce": ("pipesgd.comm", "comm"),
    "staleness": ("pipesgd.staleness", "staleness"),
    "mode": ("pipesgd.engine", "trainer.mode"),
}
"""kind -> (the package whose import registers every plugin of the kind, the config key choosing one)."""

WINGS: dict[str, tuple[str, ...]] = {"mode": ("pipesgd.live.engine", "pipesgd.live.diloco")}
"""kind -> the modules above its package that register plugins of it, imported after the package:
the torchft wing's modes (pipesgd/live/), whose engines build on the core's, so the core's package
cannot import them (tests/distributed/test_layout.py: no folder imports a higher floor)."""


class Registry(Generic[T]):
    """Plugins of one kind by name, in registration order, each with its declared facts.
    ``register(name, **facts)`` also sets ``name`` on the plugin (a class, or a function)."""

    def __init__(self, kind: str, facts: tuple[str, ...] = ()):
        self.kind = kind
        self.required = facts
        self._plugins: dict[str, T] = {}
        self._facts: dict[str, Mapping[str, object]] = {}

    def register(self, name: str, **facts) -> Callable[[T], T]:
        def deco(plugin: T) -> T:
            self.add(name, plugin, **facts)
            plugin.name = name
            return plugin

        return deco

    def add(self, name: str, plugin: T, **facts) -> T:
        """Register ``plugin`` as ``name`` without naming it (a builder several modes share, see
        :func:`pipesgd.modes.register`); :meth:`register` is this plus ``plugin.name = name``."""
        if name in self._plugins and self._plugins[name] is not plugin:
            raise ValueError(f"{self.kind} name {name!r} is registered twice")
        declared = {f: facts[f] if f in facts else getattr(plugin, f) for f in self.required
                    if f in facts or hasattr(plugin, f)}
        missing = [f for f in self.required if f not in declared]
        if missing:
            raise TypeError(f"{self.kind} {name!r} does not declare {', '.join(missing)}: every {self.kind} "
                            f"declares {', '.join(self.required)} (docs/adding-a-plugin.md)")
        self._plugins[name] = plugin
        self._facts[name] = MappingProxyType({**facts, **declared})
        return plugin

    def unregister(self, name: str) -> None:
        """Forget ``name`` if registered (for code that registers a plugin for a while, e.g. a test)."""
        self._plugins.pop(name, None)
        self._facts.pop(name, None)

    def facts(self, name: str) -> Mapping[str, object]:
        """What ``name`` declared (read-only); ValueError naming the known plugins."""
        return self._facts[self._known(name)]

    def facts_of(self, plugin: object) -> Mapping[str, object]:
        """The facts of a registered plugin given itself (a function, a class, or an instance of a
        registered class); empty for something never registered (a caller's own function)."""
        for name, known in self._plugins.items():
            if known is plugin or (isinstance(known, type) and isinstance(plugin, known)):
                return self._facts[name]
        return MappingProxyType({})

    def get(self, name: str) -> T:
        """The plugin registered as ``name``; ValueError naming the known plugins."""
        return self._plugins[self._known(name)]

    def _known(self, name: str) -> str:
        if name not in self._plugins:
            raise ValueError(f"{self.kind}={name!r} is not known; allowed: {', '.join(self._plugins)}")
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._plugins

    def __getitem__(self, name: str) -> T:
        return self._plugins[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._plugins)

    def __len__(self) -> int:
        return len(self._plugins)


def registry(kind: str) -> Registry:
    """The registry of ``kind`` (a key of :data:`KINDS`), every plugin of it registered (imports
    the kind's package and its :data:`WINGS`, and with them torch)."""
    if kind not in KINDS:
        raise ValueError(f"plugin kind {kind!r} is not known; allowed: {', '.join(KINDS)}")
    package = import_module(KINDS[kind][0])
    for module in WINGS.get(kind, ()):
        import_module(module)
    return package.REGISTRY
