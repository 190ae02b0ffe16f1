"""Registry by data: a name -> class table filled by a class decorator, so adding a compressor,
a reduction or a staleness rule is one module, with no if/elif factory to edit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes by name, in registration order. ``register(name)`` also sets ``cls.name``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(cls: T) -> T:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} name {name!r} is registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def unregister(self, name: str) -> None:
        """Forget ``name`` if registered (for code that registers a class for a while, e.g. a test)."""
        self._classes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __getitem__(self, name: str) -> T:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)
