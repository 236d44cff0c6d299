"""The request path: gateway → tokenizer → scheduler → tokenizer → gateway.

Outputs travel batched (one message per step carrying every request's delta),
so the message count per step does not grow with the batch size.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import msgspec

from .base import Message
from .errors import ErrorCode
from .sampling import SamplingParams
from .step import KVDest, TopLogprob

__all__ = [
    "AbortRequest",
    "ChatMessage",
    "FinishReason",
    "FinishRequest",
    "GenerateRequest",
    "TextBatch",
    "TextDelta",
    "TokenBatch",
    "TokenDelta",
    "TokenLogprob",
    "TokenizedRequest",
    "Usage",
]


class FinishReason(enum.StrEnum):
    """Why a request's output ended, on its last delta. A ``str``, so it travels and
    renders (msgpack, JSON, metric labels) as its value."""

    STOP = "stop"  # an EOS or stop token, or a stop string matched
    LENGTH = "length"  # max_new_tokens or the model's context reached
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # failed: the delta's ``error`` and ``error_code`` say why


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool message: the call it answers


class GenerateRequest(Message, frozen=True, kw_only=True):
    """gateway → tokenizer. Exactly one of ``text``, ``messages``, ``input_ids``."""

    TAG: ClassVar[str] = "gen.request"
    rid: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    lora_path: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    reply_to: str = ""  # role that receives TextBatch items; "" = the sender
    # With --reasoning-parser: the thinking comes back apart (TextDelta.reasoning_text).
    separate_reasoning: bool = False


class TokenizedRequest(Message, frozen=True, kw_only=True):
    """tokenizer → scheduler."""

    TAG: ClassVar[str] = "gen.tokenized"
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int] = []  # the model's, from its tokenizer: stops unless ignore_eos
    priority: int = 0
    lora_path: str | None = None
    # The adapter's id (messages/lora.py), set by the scheduler once the lora_loader
    # resolved ``lora_path`` and holds a reference for the request; "" = the base model.
    lora_id: str = ""
    # Prefill/decode disaggregation (messages/kv.py): set by a decode scheduler handing
    # the prompt to a prefill replica, whose worker ships the KV pages there.
    kv_dest: KVDest | None = None


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    rid: str
    token_ids: list[int] = []
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: ErrorCode | None = None  # set with ``error``
    grammar_backend: str | None = None  # on a constrained request's last delta: who served it


class TokenBatch(Message, frozen=True, kw_only=True):
    """scheduler → tokenizer, once per step."""

    TAG: ClassVar[str] = "gen.tokens"
    items: list[TokenDelta]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str  # display text: "\ufffd" for a token holding part of a character
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]] = []
    # The raw bytes of the token and of each of ``top`` (OpenAI's ``bytes``): exact where
    # a token is part of a UTF-8 character. Empty: not known (the text's UTF-8 is used).
    raw: bytes = b""
    top_raw: list[bytes] = []


class Usage(msgspec.Struct, frozen=True, array_like=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TextDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """New text for one request. ``finish_reason`` set means it is the last one."""

    rid: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: ErrorCode | None = None  # set with ``error``
    reasoning_text: str = ""  # thinking, when the request asked for it apart (separate_reasoning)
    grammar_backend: str | None = None  # on a constrained request's last delta: who served it


class TextBatch(Message, frozen=True, kw_only=True):
    """tokenizer → gateway (or Engine client)."""

    TAG: ClassVar[str] = "gen.text"
    items: list[TextDelta]


class AbortRequest(Message, frozen=True, kw_only=True):
    """Any → tokenizer/scheduler: stop a request at whatever stage it is in."""

    TAG: ClassVar[str] = "gen.abort"
    rid: str
    reason: FinishReason = FinishReason.ABORT


class FinishRequest(Message, frozen=True, kw_only=True):
    """tokenizer → scheduler: a stop string matched; finish now with reason ``stop``."""

    TAG: ClassVar[str] = "gen.finish"
    rid: str
    reason: FinishReason = FinishReason.STOP
