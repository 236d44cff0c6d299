"""Tool calling's pure parts: what tools and tool_choice constrain, and outputs parsed
into tool calls, whole and streamed (cut at every character)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from actorlm.gateway.errors import ApiError
from actorlm.gateway.params import Fields
from actorlm.gateway.tools import ToolCallStream, parse_tool_calls, plan_tools

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
