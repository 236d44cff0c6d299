"""The one named registry every extension point uses.

Built-ins register through the same API plugins use, so a plugin can add a
name or replace one. Each entry records where it came from (``builtin`` or the
plugin's name) so ``actorlm plugins`` can show it.

Entries may be given lazily as a dotted path ``"pkg.module:attr"``; the object
is imported on first ``get``. That keeps GPU-only code (flashinfer, triton)
out of CPU processes until someone actually asks for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "Registry",
    "RegistryEntry",
    "UnknownNameError",
    "all_registries",
    "current_source",
    "get_registry",
    "import_object",
]

T = TypeVar("T")

# The plugin whose register() is running; entries and hooks record it as their source.
current_source: ContextVar[str] = ContextVar("actorlm_plugin_source", default="builtin")


class UnknownNameError(KeyError, ValueError):
    """Asked a registry for a name it does not hold; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def import_object(path: str) -> Any:
    """Import ``"pkg.mod:attr"`` or ``"pkg.mod.attr"``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class RegistryEntry(Generic[T]):
    name: str
    target: T | str  # the object, or a lazy "module:attr" path
    source: str
    help: str = ""

    def load(self) -> T:
        if isinstance(self.target, str):
            self.target = import_object(self.target)
        return cast(T, self.target)


class Registry(Generic[T]):
    """Name → implementation for one extension point (``kind``), selectable by ``flag``."""

    def __init__(self, kind: str, flag: str = "", *, unused: str = "") -> None:
        self.kind = kind
        self.flag = flag
        # Why nothing consults this registry yet (its feature is not built); "" = in use.
        self.unused = unused
        self._entries: dict[str, RegistryEntry[T]] = {}

    def register(
        self, name: str, target: T | str | None = None, *, help: str = "", source: str | None = None
    ) -> Any:
        """Register ``target`` under ``name``; without ``target``, return a decorator.

        A later registration of the same name replaces the earlier one: that is how a
        plugin overrides a built-in.
        """
        if target is None:

            def decorator(obj: T) -> T:
                self.register(name, obj, help=help, source=source)
                return obj

            return decorator
        self._entries[name] = RegistryEntry(name, target, source or current_source.get(), help)
        return target

    def register_builtin(self, name: str, target: T | str, *, help: str = "") -> None:
        """Register a built-in unless a plugin already took ``name`` (plugins win,
        whichever module happens to be imported first)."""
        if name not in self._entries:
            self._entries[name] = RegistryEntry(name, target, "builtin", help)

    def get(self, name: str) -> T:
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            flag = f" (flag {self.flag})" if self.flag else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}{flag}; known: {known}")
        return entry.load()

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry[T]]:
        return iter(list(self._entries.values()))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> RegistryEntry[T]:
        self.get(name)  # raises the friendly error
        return self._entries[name]


_REGISTRIES: dict[str, Registry[Any]] = {}


def get_registry(kind: str, flag: str = "", *, unused: str = "") -> Registry[Any]:
    """The process-wide registry for ``kind``, created on first use.

    Registries are the one piece of process state by design: plugins fill them in
    ``register()`` before any actor starts, and actors only read them.
    """
    reg = _REGISTRIES.get(kind)
    if reg is None:
        reg = _REGISTRIES[kind] = Registry(kind, flag, unused=unused)
    elif flag and not reg.flag:
        reg.flag = flag
    return reg


def all_registries() -> dict[str, Registry[Any]]:
    return dict(_REGISTRIES)
