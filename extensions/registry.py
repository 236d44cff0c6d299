"""The one named registry every extension point uses.

Built-ins register through the same API plugins use, so a plugin can add a
name or replace one. Each entry records where it came from (``builtin`` or the
plugin's name) so ``actorlm plugins`` can show it.

Entries may be given lazily as a dotted path ``"pkg.module:attr"``; the object
is imported on first ``get``. That keeps GPU-only code (flashinfer, triton)
out of CPU processes until someone actually asks for it.

Each registry names the interface its entries implement (an ABC or a class whose
public methods are the contract, by dotted path so extensions/ imports nothing of
the engine). A plugin's entry is checked when it is registered (or, given lazily,
when it is loaded): a class that is not one, lacks a member, or takes other
arguments is refused with an ``EntryTypeError`` naming the plugin, the entry and the
member, at start-up rather than mid-request.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "EntryTypeError",
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


class EntryTypeError(TypeError, ValueError):
    """A registered entry does not implement its registry's interface."""


def _positional(fn: Any) -> int:
    """How many positional parameters ``fn`` takes (``self`` included); -1: any number."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return -1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return -1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def conformance_problem(obj: Any, interface: type) -> str:
    """Why ``obj`` does not implement ``interface`` ("" if it does). An ABC's abstract
    members are its contract, which a class may meet without subclassing it; any other
    interface (a concrete base such as ``Platform``) must be subclassed."""
    name = interface.__qualname__
    if not isinstance(obj, type):
        return f"must be a class implementing {name}, got {type(obj).__name__} {obj!r:.60}"
    abstract = sorted(getattr(interface, "__abstractmethods__", ()))
    if issubclass(obj, interface):
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        return f"does not implement {name}.{missing[0]}" if missing else ""
    if not abstract:
        return f"must subclass {interface.__module__}.{name}"
    for member in abstract:
        want = getattr(interface, member)
        got = getattr(obj, member, None)
        if got is None:
            return f"has no {member} (an implementation of {name} needs one)"
        if not callable(got):
            return f"its {member} is {type(got).__name__}, not a method as {name}.{member} is"
        need, takes = _positional(want), _positional(got)
        if need >= 0 and takes >= 0 and takes != need:
            return (
                f"its {member} takes {takes} positional parameter(s) where "
                f"{name}.{member}{inspect.signature(want)} takes {need}"
            )
    return ""


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

    def load(self, registry: Registry[T] | None = None) -> T:
        if isinstance(self.target, str):
            obj = import_object(self.target)
            if registry is not None and self.source != "builtin":
                registry.check(self.name, obj, self.source)
            self.target = obj
        return cast(T, self.target)


class Registry(Generic[T]):
    """Name → implementation for one extension point (``kind``), selectable by ``flag``."""

    def __init__(self, kind: str, flag: str = "", *, unused: str = "", interface: str = "") -> None:
        self.kind = kind
        self.flag = flag
        # Why nothing consults this registry yet (its feature is not built); "" = in use.
        self.unused = unused
        self.interface = interface  # "module:Class" every entry implements ("" = unchecked)
        self._entries: dict[str, RegistryEntry[T]] = {}

    def check(self, name: str, obj: Any, source: str) -> None:
        """Raise EntryTypeError unless ``obj`` implements this registry's interface."""
        if not self.interface:
            return
        problem = conformance_problem(obj, import_object(self.interface))
        if problem:
            raise EntryTypeError(f"{self.kind} {name!r} registered by {source}: {problem}")

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
        origin = source or current_source.get()
        if not isinstance(target, str) and origin != "builtin":
            self.check(name, target, origin)  # a plugin's entry: refused now, not mid-request
        self._entries[name] = RegistryEntry(name, target, origin, help)
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
        return entry.load(self)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[RegistryEntry[T]]:
        return iter(list(self._entries.values()))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry_source(self, name: str) -> str | None:
        """Who registered ``name`` ("builtin" or a plugin's name); None if nobody did."""
        entry = self._entries.get(name)
        return entry.source if entry is not None else None

    def entry(self, name: str) -> RegistryEntry[T]:
        self.get(name)  # raises the friendly error
        return self._entries[name]


_REGISTRIES: dict[str, Registry[Any]] = {}


def get_registry(
    kind: str, flag: str = "", *, unused: str = "", interface: str = ""
) -> Registry[Any]:
    """The process-wide registry for ``kind``, created on first use.

    Registries are the one piece of process state by design: plugins fill them in
    ``register()`` before any actor starts, and actors only read them.
    """
    reg = _REGISTRIES.get(kind)
    if reg is None:
        reg = _REGISTRIES[kind] = Registry(kind, flag, unused=unused, interface=interface)
    elif interface and not reg.interface:
        reg.interface = interface
    elif flag and not reg.flag:
        reg.flag = flag
    return reg


def all_registries() -> dict[str, Registry[Any]]:
    return dict(_REGISTRIES)
