"""Named factories that plug in: built-ins, in-process registrations, then an entry-point group.

One mechanism for every plugin point (grammar kinds: grammar/registry.py; drafters:
speculation/registry.py). A shared leaf: it imports nothing of slipstream, so every layer may
use it. What a factory is called with, and which error a user sees, stays with each plugin point.
"""
from __future__ import annotations

import importlib.metadata
import threading
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class PluginLoadError(Exception):
    """An entry point that fails to import, or names something that is not callable."""


class Plugins(Generic[F]):
    def __init__(self, what: str, group: str, builtin: tuple[str, ...]):
        self.what, self.group, self.builtin = what, group, builtin  # what: "grammar", "drafter"
        self._registered: dict[str, F] = {}
        self._loaded: dict[str, F] = {}  # entry points already imported, by name
        self._lock = threading.Lock()

    def register(self, name: str, factory: F, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string")
        if name in self.builtin:
            raise ValueError(f"{name!r} is a built-in {self.what} and cannot be replaced")
        if not callable(factory):
            raise TypeError(f"the factory for {name!r} is not callable")
        with self._lock:
            if name in self._registered and not replace:
                raise ValueError(f"a {self.what} named {name!r} is already registered (pass replace=True)")
            self._registered[name] = factory

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (and any cached entry-point load) of `name`."""
        with self._lock:
            self._registered.pop(name, None)
            self._loaded.pop(name, None)

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """The installed entry points of the group (read fresh each call)."""
        return list(importlib.metadata.entry_points(group=self.group))

    def names(self) -> list[str]:
        """Built-ins, then registered and installed plugin names."""
        with self._lock:
            names = list(self._registered)
        try:
            names += [ep.name for ep in self.entry_points()]
        except Exception:  # noqa: BLE001 - a broken installation must not hide the built-ins
            pass
        return list(dict.fromkeys([*self.builtin, *names]))

    def find(self, name: str) -> F | None:
        """The factory of plugin `name` (registered, or loaded once from its entry point); None: no
        such plugin. Raises PluginLoadError when its entry point cannot give a callable."""
        with self._lock:
            factory = self._registered.get(name) or self._loaded.get(name)
        if factory is not None:
            return factory
        ep = next((ep for ep in self.entry_points() if ep.name == name), None)
        if ep is None:
            return None
        try:
            factory = ep.load()
        except Exception as e:  # noqa: BLE001 - import errors, missing attributes, anything
            raise PluginLoadError(f"{self.what} plugin {name!r} failed to load from {ep.value!r}: "
                                  f"{type(e).__name__}: {e}") from e
        if not callable(factory):
            raise PluginLoadError(f"{self.what} plugin {name!r}: entry point {ep.value!r} is not callable")
        with self._lock:
            return self._loaded.setdefault(name, factory)
