"""Tool calling's pure parts: what tools and tool_choice constrain, and outputs parsed
into tool calls, whole and streamed (cut at every character)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from actorlm.extensions.points import GRAMMAR_BACKENDS
from actorlm.gateway.errors import ApiError
from actorlm.gateway.params import Fields
from actorlm.gateway.tools import ToolCallStream, parse_tool_calls, plan_tools
from actorlm.gpu.grammar import BaseGrammarBackend, BaseGrammarObject, GrammarContext

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def plan(body: dict[str, Any], template: bool = True) -> Any:
    return plan_tools(Fields(body), template)


def test_required_constrains_to_an_array_of_valid_calls() -> None:
    p, warnings = plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = json.loads(p.constraint["json_schema"])
    good = [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],
        [{"name": "nope", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single, _ = plan({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(single.constraint["json_schema"])["maxItems"] == 1
    assert warnings == [] and p.template_tools[1]["function"]["parameters"]["type"] == "object"


def test_named_auto_and_none() -> None:
    named, _ = plan(
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    assert json.loads(named.constraint["json_schema"]) == WEATHER["function"]["parameters"]
    auto, _ = plan({"tools": [WEATHER]})
    tag = json.loads(auto.constraint["structural_tag"])
    assert tag["triggers"] == ["<tool_call>"] and tag["structures"][0]["begin"].startswith(
        "<tool_call>"
    )
    none, _ = plan({"tools": [WEATHER], "tool_choice": "none"})
    assert none.mode == "none" and none.constraint == {}
    unsupported, warnings = plan({"tools": [WEATHER], "tool_choice": "auto"}, template=False)
    assert unsupported is None and "answered as tool_choice 'none'" in warnings[0]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice needs 'tools'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "two tools are named"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "must match"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ],
)
def test_bad_tool_requests_are_400(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError, match=needle) as info:
        plan(body)
    assert info.value.status == 400


def _streamed(p: Any, text: str) -> tuple[str, dict[int, dict[str, str]]]:
    """Feed ``text`` one character at a time; content and calls put back together."""
    stream = ToolCallStream(p)
    content, calls = "", {}
    for i, ch in enumerate(text):
        piece, deltas = stream.push(ch, final=i == len(text) - 1)
        content += piece
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = d.get("id", call["id"])
            fn = d.get("function", {})
            call["name"] = fn.get("name", call["name"])
            call["arguments"] += fn.get("arguments", "")
    return content, calls


def test_required_calls_stream_argument_by_argument() -> None:
    p, _ = plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    text = '[{"name": "get_weather", "arguments": {"city": "Rome, \\"IT\\"", "days": 2}}, {"name": "get_time", "arguments": {}}]'
    content, calls = _streamed(p, text)
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Rome, "IT"', "days": 2}
    assert json.loads(calls[1]["arguments"]) == {} and calls[0]["id"].startswith("call_")
    whole_content, whole = parse_tool_calls(p, text)
    assert whole_content is None and [json.loads(c["function"]["arguments"]) for c in whole] == [
        {"city": 'Rome, "IT"', "days": 2},
        {},
    ]


def test_named_and_auto_outputs() -> None:
    named, _ = plan(
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    content, calls = _streamed(named, '{"city": "Oslo"}')
    assert content == "" and calls[0] == {
        **calls[0],
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }
    auto, _ = plan({"tools": [WEATHER]})
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    content, calls = _streamed(auto, text)
    assert content == "Let me look." and json.loads(calls[0]["arguments"]) == {"city": "Lima"}
    assert _streamed(auto, "No tools <tool needed.") == ("No tools <tool needed.", {})
    cut = '[{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(plan({"tools": [WEATHER], "tool_choice": "required"})[0], cut) == (
        cut,
        [],
    )


# Two tools as pydantic writes nested models: both define a "Loc", differently; one
# recurses through "#", the other also reads draft-7 "definitions".
TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"$ref": "#/$defs/Loc"},
                "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            },
            "required": ["to", "then"],
            "$defs": {
                "Loc": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
PIN = {
    "type": "function",
    "function": {
        "name": "drop_pin",
        "parameters": {
            "type": "object",
            "properties": {
                "at": {"$ref": "#/$defs/Loc"},
                "zoom": {"$ref": "#/definitions/Zoom"},
            },
            "required": ["at", "zoom"],
            "$defs": {
                "Loc": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
            },
            "definitions": {"Zoom": {"type": "integer", "minimum": 1, "maximum": 20}},
        },
    },
}
# Each tool's arguments: valid for it, and invalid (the other tool's Loc, a bad Loc one
# level down the recursion, a Zoom out of range).
GOOD_ARGS = {
    "plan_trip": {"to": {"city": "Oslo"}, "then": {"to": {"city": "Rome"}, "then": None}},
    "drop_pin": {"at": [1, 2], "zoom": 3},
}
BAD_ARGS = {
    "plan_trip": [
        {"to": [1, 2], "then": None},
        {"to": {"city": "Oslo"}, "then": {"to": [1, 2], "then": None}},
    ],
    "drop_pin": [{"at": {"city": "Oslo"}, "zoom": 3}, {"at": [1, 2], "zoom": 30}],
}


def test_required_keeps_each_tools_defs_apart() -> None:
    p, _ = plan({"tools": [TRIP, PIN], "tool_choice": "required"})
    schema = json.loads(p.constraint["json_schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    for tool in (TRIP, PIN):
        name, params = tool["function"]["name"], tool["function"]["parameters"]
        jsonschema.validate(GOOD_ARGS[name], params)
        jsonschema.validate([{"name": name, "arguments": GOOD_ARGS[name]}], schema)
        for bad in BAD_ARGS[name]:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, params)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([{"name": name, "arguments": bad}], schema)
    # The tools the template renders keep their own schemas.
    assert p.template_tools[0]["function"]["parameters"] == TRIP["function"]["parameters"]


@pytest.fixture(scope="module")
def grammar_backends(tokenizer_dir: Path) -> list[BaseGrammarBackend]:
    """The built-in backends (the worker's, which answer a schema they cannot read with a
    400) over SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ctx = GrammarContext(tokenizer=tok, vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,))
    return [GRAMMAR_BACKENDS.get(name)(ctx) for name in ("xgrammar", "llguidance")]


def _accepts(
    backend: BaseGrammarBackend,
    grammar: BaseGrammarObject,
    value: Any,
    around: tuple[str, str] = ("", ""),
) -> bool:
    """Whether ``grammar`` takes ``value`` as JSON (between ``around``), then the stop
    token: written compact either way the backends write it (xgrammar ``", "``,
    llguidance ``","``)."""
    tok = backend.ctx.tokenizer
    for separators in ((", ", ": "), (",", ":")):
        text = around[0] + json.dumps(value, separators=separators) + around[1]
        ids = tok.encode(text, add_special_tokens=False)
        g = grammar.copy()
        if all(g.accept_token(t) for t in ids) and g.accept_token(backend.ctx.eos_token_ids[0]):
            return True
    return False


def test_defs_and_recursion_compile_for_every_tool_choice(
    grammar_backends: list[BaseGrammarBackend],
) -> None:
    named = {"type": "function", "function": {"name": "plan_trip"}}
    plans = {
        choice: plan({"tools": [TRIP, PIN], "tool_choice": choice})[0]
        for choice in ("required", "auto")
    }
    plans["named"] = plan({"tools": [TRIP, PIN], "tool_choice": named})[0]
    for backend in grammar_backends:
        grammars = {
            mode: backend.dispatch(*next(iter(p.constraint.items()))) for mode, p in plans.items()
        }
        for name in ("plan_trip", "drop_pin"):
            call = {"name": name, "arguments": GOOD_ARGS[name]}
            assert _accepts(backend, grammars["required"], [call]), (backend.name, name)
            for bad in BAD_ARGS[name]:
                bad_call = {"name": name, "arguments": bad}
                assert not _accepts(backend, grammars["required"], [bad_call]), (backend.name, bad)
        assert _accepts(backend, grammars["named"], GOOD_ARGS["plan_trip"]), backend.name
        assert not _accepts(backend, grammars["named"], BAD_ARGS["plan_trip"][1]), backend.name
        around = ('Let me see.<tool_call>\n{"name": "plan_trip", "arguments": ', "}\n</tool_call>")
        assert _accepts(backend, grammars["auto"], GOOD_ARGS["plan_trip"], around), backend.name
        for bad in BAD_ARGS["plan_trip"]:
            assert not _accepts(backend, grammars["auto"], bad, around), (backend.name, bad)


def test_arguments_are_the_text_the_model_wrote() -> None:
    """Whole or streamed, a call's arguments are the model's own text: not parsed and
    dumped again, which would write ``\\u00fc`` for ``ü`` and ``1.5`` for ``1.50``."""
    arguments = '{"city": "Zürich", "x": 1.50}'
    compact = '{"city":"Zürich","x":1.50}'
    required, _ = plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    auto, _ = plan({"tools": [WEATHER, TIME]})
    outputs = [
        (required, f'[{{"name": "get_weather", "arguments": {arguments}}}]', arguments),
        (required, f'[{{"name":"get_weather","arguments":{compact}}}]', compact),
        (
            auto,
            f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>',
            arguments,
        ),
    ]
    for p, text, written in outputs:
        _, whole = parse_tool_calls(p, text)
        _, streamed = _streamed(p, text)
        assert [c["function"]["arguments"] for c in whole] == [written], text
        assert streamed[0]["arguments"] == written, text
