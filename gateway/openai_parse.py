"""OpenAI request bodies → the ``GenerateRequest``s that serve them.

One OpenAI request becomes ``len(prompts) * n`` engine requests; choice ``i`` of
prompt ``p`` has index ``p * n + i``, rid ``<id>-<index>`` and, when a seed is
given, seed ``seed + i`` (so a prompt's choices differ, yet each one is
reproducible on its own).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..messages.generate import ChatMessage, GenerateRequest
from ..messages.sampling import SamplingParams
from .errors import ApiError
from .params import Fields, ModelLimits, checked_sampling, fan_out, openai_sampling
from .state import GatewayState
from .structured import response_format
from .tools import ToolPlan, plan_tools

__all__ = ["Job", "parse_chat", "parse_completion"]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = SamplingParams().max_new_tokens
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Job:
    """One OpenAI request, parsed: what to run and how to shape the answer."""

    kind: str  # "completion" | "chat"
    id: str
    model: str
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    reqs: list[GenerateRequest] = field(default_factory=list)
    tools: ToolPlan | None = None  # outputs become tool calls (required, named, auto)
    reasoning: bool = False  # outputs carry reasoning_content (--reasoning-parser)
    warnings: list[str] = field(default_factory=list)  # told to the client in the response
    lora_path: str | None = None  # the LoRA adapter ``model`` named (None: the base model)


def _common(f: Fields, state: GatewayState, kind: str, prefix: str) -> Job:
    lora = state.adapter_for(f.str("model"))
    f.str("user")  # accepted for compatibility; only its type is checked
    n = f.int("n", 1)
    if n is None or n < 1:
        raise ApiError(400, f"n must be >= 1, got {n}", param="n")
    stream = bool(f.bool("stream", False))
    opts = f.object("stream_options")
    include_usage = (
        bool(opts.bool("include_usage", False)) if opts is not None and stream else False
    )
    return Job(
        kind=kind,
        id=f"{prefix}-{uuid.uuid4().hex}",
        model=lora or state.model_name,
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=False,
        lora_path=lora,
    )


def _with_adapter(job: Job) -> list[GenerateRequest]:
    if job.lora_path is None:
        return job.reqs
    return [msgspec.structs.replace(r, lora_path=job.lora_path) for r in job.reqs]


def _max_tokens(
    f: Fields, keys: tuple[str, ...], default: int, limits: ModelLimits
) -> tuple[int, bool]:
    """The request's max_tokens, and whether it is our default (then fit to the prompt)."""
    for key in keys:
        value = f.int(key)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"{key} must be >= 1, got {value}", param=key)
            return value, False
    return min(default, limits.max_model_len), True


def _reject_unsupported(f: Fields, n: int) -> None:
    """Completions options we do not implement: an error beats silently ignoring them."""
    for name, used in (
        ("echo", bool(f.raw("echo"))),
        ("suffix", bool(f.raw("suffix"))),
        ("best_of", f.raw("best_of") not in (None, n)),
    ):
        if used:
            raise ApiError(
                400,
                f"'{name}' is not supported by this server",
                code="unsupported_parameter",
                param=name,
            )


def _prompts(f: Fields) -> list[dict[str, Any]]:
    value = f.raw("prompt")
    bad = f.bad(
        "prompt", "a string, a list of strings, a list of token ids or a list of such lists", value
    )
    if isinstance(value, str):
        return [{"text": value}]
    if not isinstance(value, list) or not value:
        raise bad
    if all(isinstance(v, str) for v in value):
        return [{"text": v} for v in value]
    if all(isinstance(v, int) for v in value):  # bool is an int: int_list refuses it
        return [{"input_ids": f.int_list("prompt")}]
    if all(isinstance(v, list) and v for v in value):
        return [{"input_ids": Fields({"prompt": v}).int_list("prompt")} for v in value]
    raise bad


def parse_completion(body: Any, state: GatewayState) -> Job:
    f = Fields(body)
    job = _common(f, state, "completion", "cmpl")
    _reject_unsupported(f, job.n)
    prompts = _prompts(f)
    top = f.int("logprobs")
    job.logprobs = top is not None
    max_tokens, fit = _max_tokens(f, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS, state.limits)
    sampling = openai_sampling(
        f, max_tokens=max_tokens, logprobs=job.logprobs, top_logprobs=top or 0
    )
    sampling = msgspec.structs.replace(sampling, fit_context=fit, **response_format(f))
    sampling = checked_sampling(sampling, state.limits)
    job.reqs = fan_out(job.id, sampling, prompts, job.n, limit=state.config.server.max_n)
    job.reqs = _with_adapter(job)
    return job


def _chat_message(item: Any, index: int) -> ChatMessage:
    f = Fields(item, f"messages[{index}]")
    role = f.str("role")
    if role not in CHAT_ROLES:
        raise ApiError(
            400,
            f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
            param="messages",
        )
    content = f.raw("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            pf = Fields(part, f"messages[{index}].content[{j}]")
            if pf.str("type") != "text" or not isinstance(pf.raw("text"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content[{j}]: only text parts are supported "
                    '({"type": "text", "text": "..."})',
                    param="messages",
                )
        content = "".join(part["text"] for part in content)
    elif content is not None and not isinstance(content, str):
        raise f.bad("content", "a string, a list of text parts or null", content)
    if content is None and role != "assistant":
        raise ApiError(
            400, f"messages[{index}].content is required for role {role!r}", param="messages"
        )
    return ChatMessage(
        role=role,
        content=content,
        name=f.str("name"),
        tool_calls=_earlier_calls(f, index),
        tool_call_id=f.str("tool_call_id"),
    )


def _earlier_calls(f: Fields, index: int) -> list[dict[str, Any]] | None:
    """An assistant message's ``tool_calls``, for the template: chat templates read
    ``function.arguments`` as an object, OpenAI sends it as JSON text."""
    raw = f.raw("tool_calls")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise f.bad("tool_calls", "a list of tool calls", raw)
    calls = []
    for j, item in enumerate(raw):
        fn = Fields(item, f"messages[{index}].tool_calls[{j}]").object("function")
        if fn is None or not isinstance(fn.raw("name"), str):
            raise ApiError(
                400, f"messages[{index}].tool_calls[{j}] needs a function name", param="messages"
            )
        args = fn.raw("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ApiError(
                    400,
                    f"messages[{index}].tool_calls[{j}].function.arguments is not JSON",
                    param="messages",
                ) from None
        calls.append({**item, "function": {**fn.body, "arguments": args}})
    return calls


def _template_kwargs(f: Fields, state: GatewayState) -> dict[str, Any]:
    """``chat_template_kwargs``, with a request's own ``chat_template`` (top level or
    inside them) only where the operator trusts requests with templates: a template
    is code the tokenizer runs."""
    kwargs = f.object("chat_template_kwargs")
    out = dict(kwargs.body) if kwargs is not None else {}
    template = f.str("chat_template")
    if template is not None:
        out["chat_template"] = template
    if "chat_template" in out and not state.config.server.trust_request_chat_template:
        raise ApiError(
            400,
            "chat templates sent with a request are refused: the model's own template is "
            "used (the operator can allow them with --trust-request-chat-template)",
            param="chat_template",
        )
    return out


def parse_chat(body: Any, state: GatewayState) -> Job:
    f = Fields(body)
    job = _common(f, state, "chat", "chatcmpl")
    raw_messages = f.raw("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise f.bad("messages", "a non-empty list of messages", raw_messages)
    messages = [_chat_message(m, i) for i, m in enumerate(raw_messages)]
    plan, job.warnings = plan_tools(f, bool(state.tokenizer_facts.get("chat_template_tools")))
    constraint = response_format(f)
    if plan is not None and plan.constraint:
        if constraint:
            raise ApiError(
                400,
                "response_format cannot constrain a request whose tool_choice already does",
                param="response_format",
            )
        constraint = plan.constraint
        job.tools = plan
    job.reasoning = bool(state.config.grammar.reasoning_parser) and bool(
        f.bool("separate_reasoning", True)
    )
    job.logprobs = bool(f.bool("logprobs", False))
    top = f.int("top_logprobs")
    if top is not None and not job.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens, fit = _max_tokens(
        f, ("max_completion_tokens", "max_tokens"), CHAT_DEFAULT_MAX_TOKENS, state.limits
    )
    sampling = openai_sampling(
        f, max_tokens=max_tokens, logprobs=job.logprobs, top_logprobs=top or 0
    )
    sampling = msgspec.structs.replace(sampling, fit_context=fit)
    template_kwargs = _template_kwargs(f, state)
    if plan is not None:
        template_kwargs["tools"] = plan.template_tools
    prompt: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": bool(f.bool("add_generation_prompt", True)),
        "chat_template_kwargs": template_kwargs,
        "separate_reasoning": job.reasoning,
    }
    sampling = msgspec.structs.replace(sampling, **constraint)
    sampling = checked_sampling(sampling, state.limits)
    job.reqs = fan_out(job.id, sampling, [prompt], job.n, limit=state.config.server.max_n)
    job.reqs = _with_adapter(job)
    return job
