"""Structured output on the embedded default model (SmolLM2-135M-Instruct): realistic
schemas asked for through the chat template come back as valid JSON, greedy, for
each built-in backend."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from actorlm import Engine

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": (
        "Describe a fictional person.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            },
            "required": ["name", "age", "email"],
        },
    ),
    "capital": (
        "What is the capital of France? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "country": {"type": "string", "maxLength": 30},
                "capital": {"type": "string", "maxLength": 30},
            },
            "required": ["country", "capital"],
        },
    ),
    "todo": (
        "List two things to do today.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "task": {"type": "string", "maxLength": 40},
                            "done": {"type": "boolean"},
                        },
                        "required": ["task", "done"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["items"],
        },
    ),
    "sentiment": (
        "Is 'I love this movie' positive or negative?",
        {
            "type": "object",
            "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
            "required": ["label"],
        },
    ),
}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with Engine(placement="inproc", kv_cache_gb=0.25, grammar_backend=request.param) as eng:
        yield eng


def test_realistic_schemas_through_the_chat_template(engine: Engine) -> None:
    async def ask(prompt: str, schema: dict[str, Any]) -> Any:
        messages = [{"role": "user", "content": prompt}]
        params = {"max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(schema)}
        return await engine.agenerate(messages, params)

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(*(ask(p, s) for p, s in SCHEMAS.values()))

    outs = asyncio.run(all_of_them())
    for (name, (_, schema)), out in zip(SCHEMAS.items(), outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert out.grammar_backend == engine.config.grammar.grammar_backend
    capital = json.loads(outs[1].text)["capital"]
    assert "Paris" in capital, capital  # the model still answers; the grammar only shapes it
