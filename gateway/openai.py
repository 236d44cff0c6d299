"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Response objects follow OpenAI's shapes field for field, so the ``openai``
package (and anything written against it) reads them unchanged. Streams wait
for the first delta before sending headers: a request the pipeline rejects
(prompt too long, say) still gets a proper 4xx instead of a 200 stream that
carries an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..messages.generate import FinishReason, TextDelta, TokenLogprob, Usage
from .body import read_json
from .lora import adapter_cards
from .openai_parse import Job, parse_chat, parse_completion
from .state import STATE, GatewayState
from .streams import SseWriter, delta_error
from .tools import ToolCallStream, parse_tool_calls

__all__ = ["chat_completions", "completions", "list_models", "routes"]


def _bytes(token: str, raw: bytes) -> list[int]:
    return list(raw or token.encode("utf-8", errors="replace"))


def chat_logprob_entries(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": _bytes(lp.token, lp.raw),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": _bytes(t, raw)}
                for (t, _id, v), raw in zip(lp.top, lp.top_raw or [b""] * len(lp.top), strict=True)
            ],
        }
        for lp in items
    ]


def _continues(raw: bytes) -> bool:
    """Whether raw starts inside a UTF-8 character (a continuation byte)."""
    return bool(raw) and raw[0] & 0xC0 == 0x80


def _chars_begun(raw: bytes) -> int:
    """Characters whose first byte is in raw."""
    return sum(1 for b in raw if b & 0xC0 != 0x80)


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions shape; ``offset`` is where this text starts in the choice.
    A token's ``text_offset`` is where its first character starts in the text: tokens
    holding parts of one character (shown as "\ufffd") share that character's offset."""
    offsets = []
    begun = False  # whether any character began in these tokens
    for lp in items:
        if not lp.raw:
            offsets.append(offset)
            offset += len(lp.token)
            continue
        # A continuation of a character begun here sits at that character (one back);
        # of one begun in an earlier delta (its text held back), at this text's start.
        offsets.append(offset - 1 if _continues(lp.raw) and begun else offset)
        chars = _chars_begun(lp.raw)
        offset += chars
        begun = begun or chars > 0
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t: v for t, _id, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    chars: int = 0
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    started: bool = False  # chat streams: the role chunk was sent
    reasoning: list[str] = field(default_factory=list)
    grammar_backend: str | None = None  # which grammar backend constrained it
    tool_stream: ToolCallStream | None = None  # chat streams with tool calls
    called: bool = False  # tool calls were sent

    def add(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.chars += len(delta.text)
        self.logprobs.extend(delta.logprobs or [])
        self.reasoning.append(delta.reasoning_text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage
            self.grammar_backend = delta.grammar_backend


def total_usage(job: Job, choices: list[Choice]) -> dict[str, Any]:
    """Prompts count once however many choices share them (as OpenAI bills ``n``)."""
    prompt = cached = completion = 0
    for c in choices:
        if c.usage is None:
            continue
        completion += c.usage.completion_tokens
        if c.index % job.n == 0:
            prompt += c.usage.prompt_tokens
            cached += c.usage.cached_tokens
    return usage_dict(prompt, completion, cached)


def _envelope(job: Job, obj: str) -> dict[str, Any]:
    return {
        "id": job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
    }


def full_response(job: Job, choices: list[Choice]) -> dict[str, Any]:
    out = _envelope(job, "text_completion" if job.kind == "completion" else "chat.completion")
    rendered = []
    for c in choices:
        text = "".join(c.text)
        if job.kind == "completion":
            lps = completion_logprobs(c.logprobs, 0) if job.logprobs else None
            rendered.append(
                {"index": c.index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
            )
        else:
            lps = (
                {"content": chat_logprob_entries(c.logprobs), "refusal": None}
                if job.logprobs
                else None
            )
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            finish: str | None = c.finish_reason  # OpenAI's own: tool_calls besides ours
            if job.reasoning:
                message["reasoning_content"] = "".join(c.reasoning) or None
            if job.tools is not None:
                content, calls = parse_tool_calls(job.tools, text)
                if calls:
                    message["content"], message["tool_calls"] = content, calls
                    finish = "tool_calls" if finish == FinishReason.STOP else finish
            rendered.append(
                {"index": c.index, "message": message, "logprobs": lps, "finish_reason": finish}
            )
        if c.grammar_backend:
            rendered[-1]["meta_info"] = {"grammar_backend": c.grammar_backend}
    out["choices"] = rendered
    out["usage"] = total_usage(job, choices)
    if job.warnings:
        out["warnings"] = job.warnings
    return out


def chunk(job: Job, choice: Choice, delta: TextDelta, *, role: bool = False) -> dict[str, Any]:
    """One streamed chunk for ``delta`` of ``choice`` (``choice`` already includes it)."""
    finish: str | None = delta.finish_reason  # OpenAI adds tool_calls
    lp_items = delta.logprobs or []
    if job.kind == "completion":
        obj = _envelope(job, "text_completion")
        lps = (
            completion_logprobs(lp_items, choice.chars - len(delta.text)) if job.logprobs else None
        )
        body = {"index": choice.index, "text": delta.text, "logprobs": lps, "finish_reason": finish}
    else:
        obj = _envelope(job, "chat.completion.chunk")
        content: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if role and job.warnings:
            obj["warnings"] = job.warnings
        if job.reasoning and delta.reasoning_text:
            content["reasoning_content"] = delta.reasoning_text
        text = delta.text
        if choice.tool_stream is not None:
            text, calls = choice.tool_stream.push(text, final=finish is not None)
            if calls:
                content["tool_calls"] = calls
                choice.called = True
            if finish == FinishReason.STOP and choice.called:
                finish = "tool_calls"
        if text:
            content["content"] = text
        lps = (
            {"content": chat_logprob_entries(lp_items), "refusal": None}
            if job.logprobs and lp_items
            else None
        )
        body = {"index": choice.index, "delta": content, "logprobs": lps, "finish_reason": finish}
        if finish is not None and delta.grammar_backend:
            body["meta_info"] = {"grammar_backend": delta.grammar_backend}
    obj["choices"] = [body]
    if job.include_usage:
        obj["usage"] = None
    return obj


async def run_job(request: web.Request, state: GatewayState, job: Job) -> web.StreamResponse:
    choices = [Choice(i) for i in range(len(job.reqs))]
    if job.stream and job.tools is not None:
        for c in choices:
            c.tool_stream = ToolCallStream(job.tools)
    async with state.fanout(job.reqs) as fan:
        if not job.stream:
            async for index, delta in fan:
                if delta.finish_reason == FinishReason.ERROR:
                    raise delta_error(delta)
                choices[index].add(delta)
            return web.json_response(full_response(job, choices))
        sse: SseWriter | None = None
        async for index, delta in fan:
            if delta.finish_reason == FinishReason.ERROR:
                if sse is None:
                    raise delta_error(delta)  # nothing sent yet: a plain HTTP error
                await sse.send(delta_error(delta).payload())
                return await sse.done()
            if sse is None:
                sse = await SseWriter.open(request)
            choice = choices[index]
            choice.add(delta)
            role = job.kind == "chat" and not choice.started
            choice.started = True
            if role or delta.text or delta.reasoning_text or delta.logprobs or delta.finish_reason:
                await sse.send(chunk(job, choice, delta, role=role))
        assert sse is not None
        if job.include_usage:
            obj = _envelope(
                job, "text_completion" if job.kind == "completion" else "chat.completion.chunk"
            )
            obj["choices"] = []
            obj["usage"] = total_usage(job, choices)
            await sse.send(obj)
        return await sse.done()


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_completion(await read_json(request, state.config.server.max_body_bytes), state)
    return await run_job(request, state, job)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_chat(await read_json(request, state.config.server.max_body_bytes), state)
    return await run_job(request, state, job)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "actorlm",
        "root": state.config.model.path or state.model_name,
        "parent": None,
        "max_model_len": state.limits.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card, *await adapter_cards(state)]})


async def model_card(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name not in state.aliases:
        for card in await adapter_cards(state):
            if card["id"] == name:
                return web.json_response(card)
    state.check_model(name)
    return web.json_response(
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "actorlm"}
    )


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", model_card),
    ]
