"""The xgrammar backend refuses a JSON schema with a keyword xgrammar would compile and
then ignore, naming the keyword and where it is; everything on its allow-list still
compiles and is enforced. Both halves measured on the real library: a refused case's
breaking instance is taken by xgrammar alone (so the refusal is needed), a supported
case's is refused through the backend (so the allow-list is true)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import xgrammar as xgr
from actorlm.gpu.grammar import BaseGrammarBackend, BaseGrammarObject, GrammarError
from actorlm.gpu.grammar.schema_support import (
    ANNOTATIONS,
    ENFORCED,
    FORMATS,
    IMPLIES_TYPE,
    NEEDS_TYPE,
)
from actorlm.gpu.grammar.xgrammar_backend import XGrammarGrammarBackend

from tests.actors.structured_schemas import SCHEMAS as PIPELINE_SCHEMAS

from .conftest import EOS

INT = {"type": "integer"}
OBJ = "object"

# keyword → (schema, an instance valid for it, one that breaks only that keyword)
SUPPORTED: dict[str, tuple[Any, Any, Any]] = {
    "type": ({"type": ["integer", "null"]}, None, "a"),
    "enum": ({"enum": [1, "a"]}, "a", 2),
    "const": ({"const": 5}, 5, 6),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 7),
    "minimum": ({"type": "number", "minimum": 1.5}, 2.0, 1.0),
    "maximum": ({"type": "integer", "maximum": 3}, 3, 4),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, 2, 3),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a"),
    "maxLength": ({"type": ["string", "null"], "maxLength": 2}, "ab", "abc"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "aa", "ab"),
    "format": ({"type": "string", "format": "date"}, "2024-01-02", "soon"),
    "items": ({"items": INT}, [1], ["a"]),
    "prefixItems": ({"type": "array", "prefixItems": [INT], "items": False}, [1], [1, 2]),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": {"type": "string"}},
        [1, "a"],
        [1, 2],
    ),
    "minItems": ({"items": INT, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [1], [1, 2]),
    "properties": ({"properties": {"a": INT}}, {"a": 1}, {"a": "x"}),
    "required": ({"type": OBJ, "properties": {"a": INT}, "required": ["a"]}, {"a": 1}, {}),
    "additionalProperties": ({"additionalProperties": INT}, {"b": 1}, {"b": "x"}),
    "unevaluatedProperties": (
        {"type": OBJ, "properties": {"a": INT}, "unevaluatedProperties": False},
        {"a": 1},
        {"a": 1, "b": 1},
    ),
    "propertyNames": (
        {"type": OBJ, "propertyNames": {"maxLength": 1}, "additionalProperties": INT},
        {"a": 1},
        {"ab": 1},
    ),
    "minProperties": ({"additionalProperties": INT, "minProperties": 1}, {"a": 1}, {}),
    "maxProperties": (
        {"type": OBJ, "additionalProperties": INT, "maxProperties": 1},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, None, "a"),
    "allOf": ({"allOf": [{"$ref": "#/$defs/i"}], "$defs": {"i": INT}, "title": "t"}, 1, "a"),
    "$ref": (
        {
            "type": OBJ,
            "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["n"],
        },
        {"n": {"n": None}},
        {"n": 1},
    ),
    "$defs": ({"$defs": {"i": INT}, "$ref": "#/$defs/i", "description": "d"}, 1, "a"),
    "definitions": (
        {"type": OBJ, "properties": {"a": {"$ref": "#/definitions/i"}}, "definitions": {"i": INT}},
        {"a": 1},
        {"a": "x"},
    ),
}
# format → (a string of it, one not)
FORMAT_SAMPLES = {
    "date": ("2024-01-02", "x"),
    "date-time": ("2024-01-02T03:04:05Z", "x"),
    "time": ("03:04:05Z", "x"),
    "duration": ("P1D", "x"),
    "email": ("a@b.co", "x"),
    "hostname": ("a.com", "a b"),
    "ipv4": ("1.2.3.4", "x"),
    "ipv6": ("::1", "x"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "x"),
    "uri": ("http://a.com", "x y"),
    "uri-reference": ("/a", "x y"),
    "uri-template": ("/a/{b}", "{"),
    "json-pointer": ("/a", "a"),
    "relative-json-pointer": ("0/a", "a"),
}
# (schema, an instance breaking it that xgrammar alone takes, what the error names)
REFUSED: dict[str, tuple[Any, Any, str]] = {
    "uniqueItems": (
        {"type": OBJ, "properties": {"tags": {"type": "array", "items": INT, "uniqueItems": True}}},
        {"tags": [1, 3, 1]},
        '"uniqueItems" (at #/properties/tags)',
    ),
    "contains": (
        {"anyOf": [{"type": "array", "items": INT, "contains": {"const": 5}}, {"type": "null"}]},
        [1],
        '"contains" (at #/anyOf/0)',
    ),
    "allOf": ({"allOf": [INT, {"minimum": 3}]}, "a", '"allOf" of more than one schema (at #)'),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, 7, '"if"'),
    "not": ({"type": "integer", "not": {"const": 3}}, 3, '"not"'),
    "oneOf": (
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
        3,
        '"oneOf"',
    ),
    "dependentRequired": (
        {"type": OBJ, "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        '"dependentRequired"',
    ),
    "patternProperties": (
        {
            "type": OBJ,
            "properties": {"a": INT},
            "patternProperties": {"^x": {"type": "string"}},
            "additionalProperties": INT,
        },
        {"a": 1, "xy": 1},
        '"patternProperties"',
    ),
    "required-unsatisfiable": (
        {"type": OBJ, "required": ["x"], "additionalProperties": False},
        {},
        '"required": "x" outside "properties"',
    ),
    "required-beyond-properties": (
        {
            "type": OBJ,
            "properties": {"a": INT},
            "required": ["a", "b"],
            "additionalProperties": INT,
        },
        {"a": 1},
        '"required": "b" outside "properties"',
    ),
    "remote-$ref": (
        {
            "type": OBJ,
            "properties": {"a/b": {"$ref": "https://example.com/s.json"}},
            "required": ["a/b"],
        },
        {"a/b": "junk"},
        '"$ref": "https://example.com/s.json", a reference outside the schema (at #/properties/a~1b)',
    ),
    "format": ({"type": "string", "format": "iri"}, "not an iri", '"format": "iri"'),
    "multipleOf-number": (
        {"type": "number", "multipleOf": 0.5},
        1.3,
        '"multipleOf" without "type": "integer"',
    ),
    "typeless-minimum": ({"minimum": 3}, 2, '"minimum" without "type": "number"'),
    "length-beside-pattern": (
        {"type": "string", "pattern": "^a+$", "maxLength": 2},
        "aaa",
        '"maxLength" beside "pattern"',
    ),
    "type-beside-enum": ({"type": "string", "enum": ["a", 1]}, 1, '"type" beside "enum"'),
    "beside-$ref": (
        {"$defs": {"i": INT}, "$ref": "#/$defs/i", "minimum": 3},
        2,
        '"minimum" beside "$ref"',
    ),
}


@pytest.fixture(scope="module")
def xgrammar(make_backend: Callable[[str], BaseGrammarBackend]) -> XGrammarGrammarBackend:
    backend = make_backend("xgrammar")
    assert isinstance(backend, XGrammarGrammarBackend)
    return backend


def takes(matcher: Any, value: Any) -> bool:
    """Whether ``matcher`` (fresh) takes ``value`` as compact JSON, to the end."""
    return bool(matcher.accept_string(json.dumps(value)) and matcher.accept_token(EOS))


def own_matcher(grammar: BaseGrammarObject) -> Any:
    return grammar.copy().matcher  # type: ignore[attr-defined]


@pytest.mark.parametrize("keyword", list(SUPPORTED))
def test_a_supported_keyword_compiles_and_is_enforced(
    xgrammar: XGrammarGrammarBackend, keyword: str
) -> None:
    schema, valid, breaking = SUPPORTED[keyword]
    grammar = xgrammar.dispatch("json_schema", json.dumps(schema))
    assert takes(own_matcher(grammar), valid)
    assert not takes(own_matcher(grammar), breaking)


def test_the_allow_list_is_what_was_measured() -> None:
    assert set(SUPPORTED) == ENFORCED | set(IMPLIES_TYPE) | set(NEEDS_TYPE)
    assert set(FORMAT_SAMPLES) == FORMATS


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_allowed_format_is_enforced(xgrammar: XGrammarGrammarBackend, fmt: str) -> None:
    grammar = xgrammar.dispatch("json_schema", json.dumps({"type": "string", "format": fmt}))
    valid, breaking = FORMAT_SAMPLES[fmt]
    assert takes(own_matcher(grammar), valid)
    assert not takes(own_matcher(grammar), breaking)


def test_annotations_are_allowed(xgrammar: XGrammarGrammarBackend) -> None:
    schema = {"type": "integer", **dict.fromkeys(ANNOTATIONS, "x")}
    assert not takes(own_matcher(xgrammar.dispatch("json_schema", json.dumps(schema))), "a")


@pytest.mark.parametrize("case", list(REFUSED))
def test_xgrammar_refuses_what_it_would_ignore(xgrammar: XGrammarGrammarBackend, case: str) -> None:
    schema, _, named = REFUSED[case]
    with pytest.raises(GrammarError) as info:
        xgrammar.dispatch("json_schema", json.dumps(schema))
    assert str(info.value).startswith("xgrammar does not enforce ") and named in str(info.value)


@pytest.mark.parametrize("case", list(REFUSED))
def test_xgrammar_alone_writes_what_the_refused_schemas_forbid(
    xgrammar: XGrammarGrammarBackend, case: str
) -> None:
    """Why each refusal is there. A failure here: this xgrammar enforces the case now,
    and schema_support's allow-list may take it (measured again)."""
    schema, breaking, _ = REFUSED[case]
    compiled = xgrammar.compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    assert takes(xgr.GrammarMatcher(compiled), breaking)


def test_a_keyword_never_measured_is_refused(xgrammar: XGrammarGrammarBackend) -> None:
    with pytest.raises(GrammarError, match='"nullable"'):
        xgrammar.dispatch("json_schema", json.dumps({"type": "string", "nullable": True}))


def test_the_pipeline_tests_schemas_still_compile(xgrammar: XGrammarGrammarBackend) -> None:
    """What users send (tests/actors/structured_schemas.py) stays with xgrammar."""
    for schema in PIPELINE_SCHEMAS.values():
        xgrammar.dispatch("json_schema", json.dumps(schema))


def test_schemas_in_structural_tags_are_checked(xgrammar: XGrammarGrammarBackend) -> None:
    """Tool calls' parameters arrive in a structural tag: SGLang's form and xgrammar's own."""
    unique = {"type": "array", "items": INT, "uniqueItems": True}
    legacy = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"},
            {"begin": "<g>", "schema": unique, "end": "</g>"},
        ],
        "triggers": ["<f>", "<g>"],
    }
    with pytest.raises(GrammarError, match=r'"uniqueItems" \(at #/structures/1/schema\)'):
        xgrammar.dispatch("structural_tag", json.dumps(legacy))
    tag = {"begin": "<f>", "content": {"type": "json_schema", "json_schema": unique}, "end": "</f>"}
    own = {"type": "structural_tag", "format": {"type": "sequence", "elements": [tag]}}
    with pytest.raises(GrammarError, match=r"at #/format/elements/0/content/json_schema\)"):
        xgrammar.dispatch("structural_tag", json.dumps(own))
    legacy["structures"][1]["schema"] = {"type": "array", "items": INT, "maxItems": 2}
    xgrammar.dispatch("structural_tag", json.dumps(legacy))
