"""Message interceptors: cap ``max_new_tokens`` at the scheduler, refuse some prompts
at the tokenizer and negative priorities at the scheduler."""

from __future__ import annotations

import msgspec
from actorlm.extensions.interceptors import InterceptContext, Reject, message_interceptor
from actorlm.messages.generate import GenerateRequest, TokenizedRequest

from .record import record

__all__ = ["MAX_NEW_TOKENS", "cap_max_new_tokens", "refuse_forbidden", "refuse_negative_priority"]

MAX_NEW_TOKENS = 8


@message_interceptor("scheduler", TokenizedRequest, "in")
def cap_max_new_tokens(msg: TokenizedRequest, ctx: InterceptContext) -> TokenizedRequest | None:
    if msg.sampling.max_new_tokens <= MAX_NEW_TOKENS:
        return None  # unchanged
    record("interceptor.capped")
    sampling = msgspec.structs.replace(msg.sampling, max_new_tokens=MAX_NEW_TOKENS)
    return msgspec.structs.replace(msg, sampling=sampling)


@message_interceptor("scheduler", TokenizedRequest, "in")
def refuse_negative_priority(msg: TokenizedRequest, ctx: InterceptContext) -> None:
    if msg.priority < 0:
        raise Reject(f"example plugin: priority {msg.priority} is below 0")


@message_interceptor("tokenizer", GenerateRequest, "in")
def refuse_forbidden(msg: GenerateRequest, ctx: InterceptContext) -> None:
    if msg.text is not None and "FORBIDDEN" in msg.text:
        raise Reject("example plugin: this prompt is not allowed")
