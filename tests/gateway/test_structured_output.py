"""Structured output over HTTP through the real ``openai`` client, for each built-in
backend: response_format, tool calls (required, named, auto; streamed and not)
validated against their schemas, reasoning_content beside content (streamed too),
bad constraints and a compile past --grammar-compile-timeout failing alone with a
400 while the server keeps serving. The model: a tiny random Llama whose tokenizer
has Qwen3-style think and tool-call tokens added and a template that renders tools."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from .conftest import API_KEY, Server, running_server
from .test_errors import call
from .test_tools import PIN, TRIP

TEMPLATE = """
{%- if tools %}<|im_start|>system
Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or "" }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer"],
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Compiles longer than the servers' 1 s timeout on a free core (xgrammar ~3 s; llguidance
# ~4 s, it compiles such a schema lazily but pays per property).
SLOW = {
    "xgrammar": {
        "type": "object",
        "properties": {
            f"f{i}": {"type": "string", "pattern": f"^[a-z]{{2,{5 + i % 7}}}$"} for i in range(400)
        },
    },
    "llguidance": {
        "type": "object",
        "properties": {
            f"f{i}": {"type": "string", "pattern": f"^[a-z]{{2,{5 + i % 7}}}$"} for i in range(5000)
        },
    },
}


@pytest.fixture(scope="module")
def thinking_model(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(tiny_model_factory("llama", vocab_size=49160), out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def structured(
    request: pytest.FixtureRequest, thinking_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-structured") / "serve.log"
    flags = ["--kv-cache-gb", "0.05", "--reasoning-parser", "qwen3"]
    flags += ["--grammar-backend", request.param, "--grammar-compile-timeout", "1"]
    with running_server(thinking_model, log, *flags) as srv:
        srv.backend = request.param  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def oai(structured: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{structured.url}/v1", api_key=API_KEY, max_retries=0)


def token_id(model: Path, text: str) -> int:
    from transformers import AutoTokenizer

    (tid,) = AutoTokenizer.from_pretrained(str(model)).encode(text, add_special_tokens=False)
    return int(tid)


def check_calls(calls: list[Any], names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for tool_call in calls:
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        fn = tool_call.function
        assert fn.name in names
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])


def streamed_calls(stream: Any) -> tuple[str, list[Any], str | None]:
    """Content, tool calls put back together from their deltas, and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                calls[d.index] = openai.types.chat.ChatCompletionMessageToolCall(
                    id=d.id, type="function", function={"name": d.function.name, "arguments": ""}
                )
            calls[d.index].function.arguments += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_gives_valid_calls(oai: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": "default",
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
    }
    # room for several calls: how many the list holds is the random model's draw (80
    # tokens cut a third call short on a Zen 4, whose bf16 sums sample other tokens)
    for seed in (1, 2):
        if stream:
            content, calls, finish = streamed_calls(
                oai.chat.completions.create(**kwargs, stream=True, seed=seed, max_tokens=256)
            )
        else:
            out = oai.chat.completions.create(**kwargs, seed=seed, max_tokens=256)
            content, calls, finish = (
                out.choices[0].message.content,
                out.choices[0].message.tool_calls,
                out.choices[0].finish_reason,
            )
        assert finish == "tool_calls" and not content
        check_calls(calls, {"get_weather", "add"})


def test_required_tools_with_defs_give_the_arguments_the_model_wrote(oai: openai.OpenAI) -> None:
    """Parameters with $defs of one name in two tools and a "#" recursion (pydantic's
    nested models) compile; a call's arguments are the model's text, whole or streamed."""
    tools = [TRIP, PIN]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    kwargs: dict[str, Any] = {
        "model": "default",
        "messages": USER,
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 96,
    }
    complete = 0
    for seed in (1, 2, 3):
        whole = oai.chat.completions.create(**kwargs, seed=seed).choices[0]
        content, calls, finish = streamed_calls(
            oai.chat.completions.create(**kwargs, seed=seed, stream=True)
        )
        assert finish == whole.finish_reason and not content
        if finish != "tool_calls":
            continue  # the random model's calls ran past max_tokens
        complete += 1
        written = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert [(c.function.name, c.function.arguments) for c in calls] == written
        for name, arguments in written:
            jsonschema.validate(json.loads(arguments), schemas[name])
    assert complete, "no seed finished its calls within max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_without_parallel_calls(oai: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": "default",
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 40,
    }
    if stream:
        _, calls, _ = streamed_calls(oai.chat.completions.create(**kwargs, stream=True))
    else:
        calls = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
    check_calls(calls, {"add"})
    assert len(calls) == 1
    required = oai.chat.completions.create(
        **{**kwargs, "tool_choice": "required", "temperature": 1.0, "seed": 5, "max_tokens": 60}
    )
    assert len(required.choices[0].message.tool_calls) == 1  # parallel_tool_calls=False


def test_auto_lets_the_model_call_when_the_template_renders_tools(
    oai: openai.OpenAI, thinking_model: Path
) -> None:
    start = token_id(thinking_model, "<tool_call>")
    plain = oai.chat.completions.create(
        model="default", messages=USER, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # The model is made to open a call at once; the structural tag makes it a valid one.
    forced = oai.chat.completions.create(
        model="default",
        messages=USER,
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        logit_bias={str(start): 100},
    )
    check_calls(forced.choices[0].message.tool_calls, {"get_weather", "add"})
    assert "warnings" not in (forced.model_extra or {})


def test_auto_without_template_support_is_none_and_says_so(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(
        model=server.model, messages=USER, tools=TOOLS, max_tokens=4
    )
    assert out.choices[0].message.tool_calls is None
    assert "answered as tool_choice 'none'" in out.model_extra["warnings"][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_and_object(
    oai: openai.OpenAI, structured: Server, stream: bool
) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    for response_format, schema in ((fmt, SCHEMA), ({"type": "json_object"}, {"type": "object"})):
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": USER,
            "response_format": response_format,
            "seed": 3,
            "max_tokens": 48,
        }
        if response_format["type"] == "json_object":
            kwargs["max_tokens"], kwargs["temperature"] = 24, 0  # any object: greedy is short here
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in oai.chat.completions.create(**kwargs, stream=True)
            )
        else:
            out = oai.chat.completions.create(**kwargs)
            text = out.choices[0].message.content
            assert out.choices[0].model_extra["meta_info"]["grammar_backend"] == structured.backend  # type: ignore[attr-defined]
        if response_format["type"] == "json_schema" or text.endswith("}"):
            jsonschema.validate(json.loads(text), schema)
    # A closed think block ends the prompt: the answer (constrained) comes at once.
    completion = oai.completions.create(
        model="default",
        prompt="JSON: <think>\n</think>",
        max_tokens=48,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_reasoning_comes_apart_and_the_constraint_follows_it(
    oai: openai.OpenAI, thinking_model: Path
) -> None:
    end = token_id(thinking_model, "</think>")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    thought_and_answered = 0
    for bias, seed in ((4, 1), (4, 2), (6, 1), (8, 1), (8, 3)):
        kwargs: dict[str, Any] = {
            "model": "default",
            "messages": USER,
            "response_format": fmt,
            "seed": seed,
            "max_tokens": 64,
            "logit_bias": {str(end): bias},  # make the random model end its thinking
            "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
        }
        whole = oai.chat.completions.create(**kwargs).choices[0]
        if whole.finish_reason != "stop" or not whole.message.content:
            continue  # still thinking at the token limit, or stopped while thinking
        jsonschema.validate(json.loads(whole.message.content), SCHEMA)
        reasoning = whole.message.model_extra["reasoning_content"]
        assert "</think>" not in (reasoning or "") + whole.message.content
        thought_and_answered += bool(reasoning)
        chunks = list(oai.chat.completions.create(**kwargs, stream=True))
        assert "".join(
            c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
        ) == (reasoning or "")
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert thought_and_answered, "no case thought, then answered in JSON"


def test_bad_constraints_are_400_and_the_server_keeps_serving(
    oai: openai.OpenAI, structured: Server
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    with pytest.raises(openai.BadRequestError, match="objec"):
        oai.chat.completions.create(
            model="default", messages=USER, response_format=bad, max_tokens=4
        )
    for params, needle in (
        ({"regex": "[0-9"}, "invalid regex"),
        ({"ebnf": 'root ::= "a" nowhere'}, "nowhere"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of"),
    ):
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **params}}
        status, body, _ = call(structured, "POST", "/generate", json=body)
        assert status == 400 and needle in body["error"]["message"], body
    params = {"max_new_tokens": 8, "regex": "[a-z]{3}", "temperature": 0}
    status, body, _ = call(
        structured, "POST", "/generate", json={"text": "Hi", "sampling_params": params}
    )
    assert status == 200 and body["meta_info"]["grammar_backend"] == structured.backend  # type: ignore[attr-defined]
    assert len(body["text"]) == 3 and body["text"].isalpha()


def test_a_compile_past_the_timeout_fails_that_request_alone(
    oai: openai.OpenAI, structured: Server
) -> None:
    slow = {
        "type": "json_schema",
        "json_schema": {"name": "slow", "schema": SLOW[structured.backend]},
    }  # type: ignore[attr-defined]
    others: list[Any] = []

    def run_others() -> None:
        others.append(oai.chat.completions.create(model="default", messages=USER, max_tokens=8))
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        others.append(
            oai.chat.completions.create(
                model="default", messages=USER, response_format=fmt, max_tokens=48, seed=3
            )
        )

    side = threading.Thread(target=run_others)
    side.start()
    with pytest.raises(openai.BadRequestError, match="--grammar-compile-timeout"):
        oai.chat.completions.create(
            model="default", messages=USER, response_format=slow, max_tokens=8
        )
    side.join(60)
    assert len(others) == 2 and others[0].choices[0].message.content
    jsonschema.validate(json.loads(others[1].choices[0].message.content), SCHEMA)
