"""The schema of every message, for ``actorlm messages`` and for non-Python peers.

``message_schemas()`` maps each stable tag to the JSON schema of its body (the
wire is msgpack, whose types JSON schema describes). ``print_schemas()`` writes
a readable listing: tag, class, and each field with its type and default.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from typing import Any, TextIO

import msgspec
import numpy as np

from .messages.base import Message, message_types

__all__ = ["load_message_modules", "message_schemas", "print_schemas"]

# How a numpy array field appears in a body: a reference to an extra raw frame.
_TENSOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "a tensor: its bytes travel as raw frame 2 + __tensor__",
    "properties": {
        "__tensor__": {"type": "integer", "minimum": 0},
        "dtype": {"type": "string", "description": "numpy dtype.str, e.g. '<f4'"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
    "required": ["__tensor__", "dtype", "shape"],
}


def load_message_modules() -> dict[str, type[Message]]:
    """Import every module of ``actorlm.messages`` (registering its tags); the registry."""
    package = importlib.import_module("actorlm.messages")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return message_types()


def _schema_hook(typ: type) -> dict[str, Any]:
    if typ is np.ndarray:
        return dict(_TENSOR_SCHEMA)
    raise NotImplementedError(typ)


def message_schemas() -> dict[str, dict[str, Any]]:
    """tag → JSON schema of the message body, for every registered message."""
    return {
        tag: msgspec.json.schema(cls, schema_hook=_schema_hook)
        for tag, cls in load_message_modules().items()
    }


def _type_name(typ: Any) -> str:
    if isinstance(typ, type) and not getattr(typ, "__args__", None):
        return typ.__name__
    # typing reprs name modules ("typing.Any", "actorlm.messages.x.Y"): keep the last part.
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", repr(typ))


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return ""
    if field.default is not msgspec.NODEFAULT:
        value = field.default
        return (
            f" = {value!r}"
            if not isinstance(value, msgspec.Struct)
            else f" = {type(value).__name__}()"
        )
    empty = {list: "[]", dict: "{}", set: "set()"}.get(field.default_factory)  # type: ignore[call-overload]
    return f" = {empty or getattr(field.default_factory, '__name__', 'factory') + '()'}"


def print_schemas(file: TextIO | None = None) -> None:
    """Print every message: its tag, class, docstring's first line, fields with types."""
    out = file if file is not None else sys.stdout
    types = load_message_modules()
    width = max((len(tag) for tag in types), default=0)
    for tag, cls in types.items():
        doc = (cls.__doc__ or "").strip().splitlines()
        summary = f"  — {doc[0]}" if doc else ""
        print(f"{tag:<{width}}  {cls.__module__}.{cls.__qualname__}{summary}", file=out)
        for field in msgspec.structs.fields(cls):
            print(f"    {field.name}: {_type_name(field.type)}{_default(field)}", file=out)
        print(file=out)
