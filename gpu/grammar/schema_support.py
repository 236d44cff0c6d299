"""The JSON schemas xgrammar enforces, checked before it compiles one.

xgrammar compiles a schema with a keyword it does not read (``uniqueItems``,
``if``/``then``, a remote ``$ref``...) without a word and ignores the keyword, so the
output breaks the schema while the request ends "stop". So the xgrammar backend walks
each schema first and raises :class:`GrammarError` naming the keyword and where it is:
the manager then tries the fallback backend, or the client gets a 400 saying why.

The sets below are an allow-list, measured on xgrammar 0.2.9 in strict mode (as the
backend compiles): for each keyword, a schema and an instance that breaks only that
keyword, checked with ``xgrammar.testing._is_grammar_accept_string``; a keyword is
allowed where that instance is refused and a valid one accepted. The rules beside the
sets (a keyword read only with a "type", or alone) were measured the same way.
``tests/gpu/grammar/test_schema_support.py`` repeats the measurement both ways, so an
xgrammar upgrade that changes it fails there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .base import GrammarError

__all__ = ["check_schema", "check_tag_schemas"]

# Constrain nothing (contentEncoding and the rest are annotations since draft 2019-09).
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
    | {"deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType"}
    | {"contentSchema"}
)
# Enforced in any schema. Those of IMPLIES_TYPE also make a schema without "type" an
# object or an array for xgrammar.
ENFORCED = frozenset({"type", "enum", "const", "$ref", "anyOf", "allOf", "$defs", "definitions"})
IMPLIES_TYPE = {
    **dict.fromkeys(
        ("properties", "additionalProperties", "propertyNames", "unevaluatedProperties"), "object"
    ),
    **dict.fromkeys(("items", "prefixItems", "unevaluatedItems"), "array"),
}
# Enforced only where the schema's type is known ("type", or a keyword above), and is
# one of these: without one, xgrammar writes any JSON.
NEEDS_TYPE = {
    **dict.fromkeys(
        ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), ("number", "integer")
    ),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), ("string",)),
    **dict.fromkeys(("required", "minProperties", "maxProperties"), ("object",)),
    **dict.fromkeys(("minItems", "maxItems"), ("array",)),
    "multipleOf": ("integer",),  # of "number": ignored (xgrammar logs a warning)
}
FORMATS = frozenset(
    {"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
    | {"uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
)
# xgrammar reads one of these alone: another keyword beside it is ignored, bar
# annotations, definitions, and a "type" that every value of enum/const has.
ALONE = ("$ref", "anyOf", "allOf", "enum", "const")
# A string's "format" or "pattern" is read alone too: its length bounds are ignored
# beside either, and "pattern" beside "format".
STRING_ALONE = ("format", "pattern")
# Not "patternProperties": xgrammar matches a pattern against the whole name (JSON
# Schema: anywhere in it), so a name the pattern finds may get "additionalProperties"'s
# schema instead, and a name two patterns match gets one's. Not "oneOf": where xgrammar
# cannot prove the branches disjoint it reads anyOf (and only warns in its log).

_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_JSON_TYPE: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}
_JSON_TYPE |= {type(None): "null", dict: "object", list: "array"}


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise GrammarError if xgrammar would not enforce all of ``schema`` (a JSON schema
    as parsed; ``path``: where it sits in what the client sent)."""
    if not isinstance(schema, dict):
        return  # true, false, or malformed: xgrammar's own error says what is wrong
    problem = _problem(schema)
    if problem is not None:
        keyword, why = problem
        raise GrammarError(f'xgrammar does not enforce "{keyword}"{why} (at {path})')
    for step, sub in _subschemas(schema):
        check_schema(sub, f"{path}/{step}")


def check_tag_schemas(node: Any, path: str = "#") -> None:
    """Check the schema in every ``"json_schema"`` of xgrammar's own structural-tag
    format (``{"type": "json_schema", "json_schema": ...}`` and the like)."""
    if isinstance(node, dict):
        for key, value in node.items():
            check = check_schema if key == "json_schema" else check_tag_schemas
            check(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            check_tag_schemas(value, f"{path}/{i}")


def _problem(schema: dict[str, Any]) -> tuple[str, str] | None:
    """The keyword of ``schema`` (its subschemas aside) xgrammar would ignore, and why
    where the keyword alone does not say."""
    stated = schema.get("type")
    types = {stated} if isinstance(stated, str) else set()
    if isinstance(stated, list):
        types = {t for t in stated if isinstance(t, str)}
    types = types or {t for k, t in IMPLIES_TYPE.items() if k in schema}
    alone = next((k for k in ALONE if k in schema), None)
    shape = next((k for k in STRING_ALONE if k in schema), None)
    for key in schema:
        if key in ANNOTATIONS or key in ("$defs", "definitions", alone):
            continue
        if key not in ENFORCED and key not in IMPLIES_TYPE and key not in NEEDS_TYPE:
            return key, ""
        if alone and not (key == "type" and alone in ("enum", "const") and _fits(schema, types)):
            return key, f' beside "{alone}"'
        if key in NEEDS_TYPE and types.isdisjoint(NEEDS_TYPE[key]):
            return key, f' without "type": "{NEEDS_TYPE[key][0]}"'
        if shape and key != shape and key in ("pattern", "minLength", "maxLength"):
            return key, f' beside "{shape}"'
    return _value_problem(schema, types)


def _value_problem(schema: dict[str, Any], types: set[str]) -> tuple[str, str] | None:
    """The keyword of ``schema`` that xgrammar reads only with other values."""
    ref, all_of, fmt = schema.get("$ref"), schema.get("allOf"), schema.get("format")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return "$ref", f": {json.dumps(ref)}, a reference outside the schema"
    if isinstance(all_of, list) and len(all_of) > 1:
        return "allOf", " of more than one schema"
    if isinstance(fmt, str) and fmt not in FORMATS:
        return "format", f": {json.dumps(fmt)}"
    step = schema.get("multipleOf")
    if "multipleOf" in schema and ("number" in types or type(step) is not int or step < 1):
        return "multipleOf", ' but a whole number with "type": "integer"'
    required, properties = schema.get("required"), schema.get("properties")
    for name in required if isinstance(required, list) else []:
        if not isinstance(properties, dict) or name not in properties:
            return "required", f': {json.dumps(name)} outside "properties"'
    return None


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(JSON-pointer step, subschema)`` for each subschema of ``schema``'s keywords."""
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield f"{key}/{name.replace('~', '~0').replace('/', '~1')}", sub
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            yield from ((f"{key}/{i}", sub) for i, sub in enumerate(value))
        elif key in _SCHEMA_ONE:
            yield key, value
        elif key == "propertyNames" and isinstance(value, dict):
            yield key, {"type": "string", **value}  # xgrammar knows a name is a string


def _fits(schema: dict[str, Any], types: set[str]) -> bool:
    """Every value of ``schema``'s enum (or its const) has one of ``types``."""
    values = schema["enum"] if "enum" in schema else [schema.get("const")]
    if "number" in types:
        types = types | {"integer"}
    return isinstance(values, list) and all(_JSON_TYPE.get(type(v)) in types for v in values)
