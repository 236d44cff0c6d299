"""JSON schemas every backend must satisfy on a random tiny model: each one bounded
(string lengths, item counts, number ranges) so a random model's output ends within
a small token budget, and together covering what users send: nested objects, arrays
with bounds, enums and consts, numbers with bounds, optional and required fields,
anyOf, string patterns and formats."""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMAS"]

_NAME = {"type": "string", "maxLength": 8}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat-required": {
        "type": "object",
        "properties": {"name": _NAME, "age": _SMALL},
        "required": ["name", "age"],
    },
    "optional-fields": {
        "type": "object",
        "properties": {"id": _SMALL, "nick": _NAME, "admin": {"type": "boolean"}},
        "required": ["id"],
    },
    "nested-object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": _NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": _NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "array-bounds": {"type": "array", "items": _SMALL, "minItems": 2, "maxItems": 4},
    "array-of-objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": _NAME, "v": _SMALL},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "enum-strings": {"type": "string", "enum": ["red", "green", "blue"]},
    "enum-mixed": {"enum": ["on", 0, 1.5, True, None]},
    "const": {
        "type": "object",
        "properties": {"v": {"const": "1.0"}, "n": _SMALL},
        "required": ["v", "n"],
    },
    "integer-range": {"type": "integer", "minimum": -50, "maximum": 50},
    "integer-exclusive": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "number-range": {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    },
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "string-length": {"type": "string", "minLength": 3, "maxLength": 5},
    "string-pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "format-date": {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}},
        "required": ["d"],
    },
    "format-uuid": {"type": "string", "format": "uuid"},
    "pattern-choice": {"type": "string", "pattern": "^(yes|no|maybe)!?$"},
    "anyof-scalar": {"anyOf": [{"type": "boolean"}, _SMALL, {"type": "null"}]},
    "anyof-objects": {
        "anyOf": [
            {"type": "object", "properties": {"cat": _NAME}, "required": ["cat"]},
            {"type": "object", "properties": {"dog": _SMALL}, "required": ["dog"]},
        ]
    },
    "tuple": {
        "type": "array",
        "prefixItems": [_SMALL, {"type": "string", "enum": ["x", "y"]}, {"type": "boolean"}],
        "minItems": 3,
        "maxItems": 3,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": _SMALL, "y": _SMALL},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    "nullable-field": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["note"],
    },
    "deep-arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "maxItems": 2,
    },
    "empty-object": {"type": "object", "properties": {}},
    "mixed-record": {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "code": {"type": "integer", "minimum": 100, "maximum": 599},
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                "maxItems": 2,
            },
        },
        "required": ["status", "code", "tags"],
    },
}
