"""``GET /openapi.json``: the HTTP API described as OpenAPI 3.0, for clients and for the
fuzz tests (schemathesis generates requests from it). Request bodies are described
as the parsers in ``openai_parse``, ``native`` and ``params`` read them; docs/api.md
says the rest in prose."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .state import STATE

__all__ = ["openapi_document", "routes"]

_ERROR = {"$ref": "#/components/schemas/Error"}
_JSON = "application/json"


def _sampling(max_tokens: int) -> dict[str, Any]:
    """The sampling fields the OpenAI routes share (with actorlm's extensions)."""
    number = {"type": "number"}
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens},
        "temperature": {**number, "minimum": 0, "maximum": 2},
        "top_p": {**number, "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": 1000},
        "min_p": {**number, "minimum": 0, "maximum": 1},
        "presence_penalty": {**number, "minimum": -2, "maximum": 2},
        "frequency_penalty": {**number, "minimum": -2, "maximum": 2},
        "repetition_penalty": {**number, "minimum": 0, "exclusiveMinimum": True, "maximum": 2},
        "n": {"type": "integer", "minimum": 1, "maximum": 4},
        "seed": {"type": "integer"},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0},
        "logit_bias": {"type": "object", "additionalProperties": {"type": "number"}},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "user": {"type": "string"},
    }


# Structured output (docs/api.md): what the parsers in gateway/structured.py and
# gateway/tools.py read; whether a schema, regex or grammar compiles is the worker's 400.
_RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
        "json_schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "schema": {"type": "object"},
                "strict": {"type": "boolean"},
            },
        },
    },
}
_TOOLS = {
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                    },
                },
            },
        },
    },
    "tool_choice": {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"enum": ["function"]},
                    "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                },
            },
        ]
    },
    "parallel_tool_calls": {"type": "boolean"},
}
_CONSTRAINTS = {k: {"type": "string"} for k in ("json_schema", "regex", "ebnf", "structural_tag")}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {_JSON: {"schema": schema}}}


def _answers(ok: str, *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": ok}}
    for status in errors:
        out[str(status)] = {"description": "error", "content": {_JSON: {"schema": _ERROR}}}
    return out


def _post(summary: str, schema: dict[str, Any], ok: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": _body(schema),
            "responses": _answers(ok, 400, 401, 404, 413, 429, 503),
        }
    }


def _get(summary: str, ok: str = "OK") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": _answers(ok, 401, 503)}}


def openapi_document(model: str, max_tokens: int, version: str = "") -> dict[str, Any]:
    """The API of a server serving ``model`` with ``max_tokens`` of context."""
    sampling = _sampling(max_tokens)
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"type": "string"},
            "name": {"type": "string"},
            "tool_call_id": {"type": "string"},
        },
    }
    completion = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **sampling,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                ]
            },
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "response_format": _RESPONSE_FORMAT,
        },
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **sampling,
            "messages": {"type": "array", "items": message, "minItems": 1},
            "max_completion_tokens": sampling["max_tokens"],
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "chat_template_kwargs": {"type": "object"},
            "add_generation_prompt": {"type": "boolean"},
            "response_format": _RESPONSE_FORMAT,
            **_TOOLS,
            "separate_reasoning": {"type": "boolean"},
        },
    }
    native_sampling = {
        "type": "object",
        "properties": {
            "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": max_tokens},
            **{k: v for k, v in sampling.items() if k in _NATIVE_SHARED},
            **_CONSTRAINTS,
        },
    }
    generate = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "input_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "rid": {"type": "string"},
            "sampling_params": native_sampling,
            "lora_path": {"type": "string", "description": "a LoRA adapter's name"},
            "stream": {"type": "boolean"},
            "return_logprob": {"type": "boolean"},
            "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": 20},
        },
    }
    abort = {"type": "object", "properties": {"rid": {"type": "string"}}}
    load = {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string"},
            "lora_path": {"type": "string"},
            "pinned": {"type": "boolean"},
        },
    }
    unload = {"type": "object", "required": ["lora_name"], "properties": load["properties"]}
    replica = {
        "type": "object",
        "required": ["replica"],
        "properties": {
            "replica": {"type": "integer"},
            "restart": {"type": "boolean"},
            "timeout": {"type": "number", "minimum": 0},
        },
    }
    lora = {
        f"{prefix}/{verb}_lora_adapter": _post(summary, schema, "done")
        for prefix in ("", "/v1")
        for verb, summary, schema in (
            ("load", "serve a PEFT LoRA adapter under a name", load),
            ("unload", "stop serving an adapter (after the requests using it)", unload),
        )
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": f"actorlm serving {model}", "version": version or "0"},
        "paths": {
            "/v1/completions": _post("OpenAI text completions", completion, "a completion"),
            "/v1/chat/completions": _post("OpenAI chat completions", chat, "a chat completion"),
            "/v1/models": _get("the served model and its LoRA adapters", "a model list"),
            "/generate": _post("native generation (SGLang's shape)", generate, "the outputs"),
            "/abort_request": _post("abort a request by id (all without one)", abort, "done"),
            "/flush_cache": {
                "post": {
                    "summary": "clear the prefix cache",
                    "responses": _answers("done", 400, 401, 503),
                }
            },
            "/drain": {
                "post": {
                    "summary": "stop admitting, finish what runs (--shutdown-timeout), then stop",
                    "responses": _answers("draining", 401),
                }
            },
            "/drain_replica": _post(
                "take a data-parallel replica out of routing, finish what it runs, restart it",
                replica,
                "drained (and restarted)",
            ),
            "/resume_replica": _post("route to a drained replica again", replica, "resumed"),
            "/get_model_info": _get("model facts"),
            "/get_server_info": _get("version, readiness, config, actor stats"),
            "/health": {"get": {"summary": "readiness", "responses": _answers("ok", 503)}},
            "/health_generate": _get("one real token through the pipeline"),
            **lora,
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "code": {"type": "string"},
                                "param": {"type": "string", "nullable": True},
                            },
                        }
                    },
                }
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


_NATIVE_SHARED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
)


async def openapi_json(request: web.Request) -> web.Response:
    state = request.app[STATE]
    doc = openapi_document(state.model_name, state.limits.max_model_len)
    return web.json_response(doc)


def routes() -> list[web.RouteDef]:
    return [web.get("/openapi.json", openapi_json)]
