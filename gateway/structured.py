"""Structured-output fields of a request → the ``SamplingParams`` constraint fields.

Native ``sampling_params``: ``json_schema`` (JSON text, or an object), ``regex``,
``ebnf``, ``structural_tag`` (JSON text or an object), at most one. OpenAI
``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, and
SGLang's ``{"type": "structural_tag", "structures": [...], "triggers": [...]}``.

Only the shape is checked here (the gateway has no grammar library): whether a
schema, regex or grammar compiles is the worker's to say, as a 400 naming the
problem, before the request takes a batch slot.
"""

from __future__ import annotations

import json
from typing import Any

from ..messages.sampling import CONSTRAINT_KINDS
from .errors import ApiError
from .params import Fields

__all__ = ["JSON_OBJECT_SCHEMA", "native_constraint", "response_format"]

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


def _json_text(f: Fields, key: str) -> str | None:
    """A JSON document given as text (SGLang's way) or inline; returned as text."""
    value = f.raw(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as exc:
            raise ApiError(
                400, f"'{f.name(key)}' is not valid JSON: {exc}", param=f.name(key)
            ) from None
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise f.bad(key, "a JSON object (or its text)", value)


def native_constraint(f: Fields) -> dict[str, str]:
    """The constraint fields of SGLang's ``sampling_params`` (at most one)."""
    out: dict[str, str] = {}
    for kind in CONSTRAINT_KINDS:
        is_json = kind in ("json_schema", "structural_tag")
        value = _json_text(f, kind) if is_json else f.str(kind)
        if value is not None:
            out[kind] = value
    _one(out, "sampling_params")
    return out


def _one(found: dict[str, str], param: str) -> None:
    if len(found) > 1:
        raise ApiError(
            400,
            f"give at most one of {', '.join(CONSTRAINT_KINDS)} (got {', '.join(found)})",
            param=param,
        )
    for kind, value in found.items():
        if not value:
            raise ApiError(400, f"{kind} must not be empty", param=param)


def response_format(f: Fields) -> dict[str, str]:
    """The constraint fields for OpenAI's ``response_format`` ({} for text or absent)."""
    fmt = f.object("response_format")
    if fmt is None:
        return {}
    kind = fmt.str("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.object("json_schema")
        if spec is None:
            raise ApiError(
                400,
                "response_format json_schema needs 'json_schema': {name, schema, strict}",
                param="response_format",
            )
        spec.str("name")
        spec.bool("strict")  # the constraint is always strict: output follows the schema
        schema = spec.raw("schema")
        if schema is None:
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if not isinstance(schema, (dict, bool)):
            raise spec.bad("schema", "a JSON schema (an object)", schema)
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        body: dict[str, Any] = dict(fmt.body)
        return {"structural_tag": json.dumps(body)}
    raise ApiError(
        400,
        f"response_format type {kind!r} is not one of text, json_object, json_schema, "
        "structural_tag",
        param="response_format",
    )
