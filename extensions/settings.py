"""A plugin's settings: ``--plugin-config NAME.KEY=VALUE`` (repeatable) or a
``[plugins.NAME]`` table in a deployment file, handed to the plugin's ``register``
in every process that loads it.

A plugin receives them by taking one parameter::

    def register(settings: PluginSettings) -> None:
        limit = settings.get_int("max_tokens", 64)

Values from the command line are read as TOML values (``3`` is an int, ``true`` a
bool, ``"a b"`` or a bare word a string), so a flag and a file give the same types.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["PluginSettings", "parse_plugin_config"]


class PluginSettings(Mapping[str, Any]):
    """Read-only ``key → value`` for one plugin, with typed getters."""

    def __init__(self, plugin: str, values: Mapping[str, Any] | None = None) -> None:
        self.plugin = plugin
        self._values = dict(values or {})

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PluginSettings({self.plugin!r}, {self._values!r})"

    def _typed(self, key: str, default: Any, kind: type | tuple[type, ...], what: str) -> Any:
        if key not in self._values:
            return default
        value = self._values[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(
                f"plugin {self.plugin!r}: setting {key!r} must be {what}, got {value!r}"
            )
        return value

    def get_str(self, key: str, default: str | None = None) -> str | None:
        return self._typed(key, default, str, "a string")  # type: ignore[no-any-return]

    def get_int(self, key: str, default: int | None = None) -> int | None:
        return self._typed(key, default, int, "an integer")  # type: ignore[no-any-return]

    def get_float(self, key: str, default: float | None = None) -> float | None:
        value = self._typed(key, default, (int, float), "a number")
        return None if value is None else float(value)

    def get_bool(self, key: str, default: bool | None = None) -> bool | None:
        return self._typed(key, default, bool, "true or false")  # type: ignore[no-any-return]


def _value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def parse_plugin_config(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["name.key=value", ...]`` → ``{"name": {"key": value}}``; ValueError naming a
    malformed item."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        left, sep, text = item.partition("=")
        name, dot, key = left.strip().partition(".")
        if not sep or not dot or not name or not key:
            raise ValueError(f"--plugin-config {item!r}: give NAME.KEY=VALUE")
        out.setdefault(name, {})[key.strip()] = _value(text.strip())
    return out
