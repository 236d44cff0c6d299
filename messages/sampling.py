"""Sampling parameters: one frozen struct shared by every actor that touches a request,
and the ranges it allows (checked once, where a request enters the engine)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_TOP_LOGPROBS",
    "LogitProcessorSpec",
    "SamplingParams",
    "check_sampling",
]

MAX_TOP_LOGPROBS = 20
# Structured output: the SamplingParams fields that constrain it, one at a time.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class LogitProcessorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A registered logit processor chosen by name, with JSON-able parameters (never code)."""

    name: str
    params: dict[str, Any] = {}


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling. ``temperature == 0`` (or ``top_k == 1``) means greedy.

    Defaults follow SGLang's ``sampling_params`` names so native clients feel at home.
    """

    max_new_tokens: int = 128
    # max_new_tokens is a default the client did not ask for: where prompt plus it
    # passes the context, the tokenizer lowers it to what the prompt leaves (vLLM's
    # OpenAI server fills an omitted max_tokens so) rather than refusing the request.
    fit_context: bool = False
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0  # how many alternatives per position, when logprobs
    logit_processors: list[LogitProcessorSpec] = []
    # Structured output (SGLang's names): at most one; the JSON ones as JSON text.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the output constraint (kind in CONSTRAINT_KINDS), or None."""
        for kind in CONSTRAINT_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None


def check_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` with a client-facing message unless ``p`` can be served by a
    model of ``vocab_size`` tokens. Run once, where a request enters (the gateway, the
    Python Engine); logit processors check their own parameters where they are built."""

    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise ValueError(msg)

    # Written as "not (x in range)" forms so that NaN fails every check.
    require(
        p.temperature >= 0 and math.isfinite(p.temperature),
        f"temperature must be >= 0, got {p.temperature}",
    )
    require(0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}")
    require(p.top_k >= -1, f"top_k must be -1 or 0 (off) or >= 1, got {p.top_k}")
    require(0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}")
    require(
        p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty),
        f"repetition_penalty must be > 0, got {p.repetition_penalty}",
    )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(p, name)
        require(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
    for tok, bias in p.logit_bias.items():
        require(
            0 <= tok < vocab_size,
            f"logit_bias token id {tok} is outside the vocabulary (size {vocab_size})",
        )
        require(
            -100 <= bias <= 100, f"logit_bias for token {tok} must be in [-100, 100], got {bias}"
        )
    for tok in p.stop_token_ids:
        require(
            0 <= tok < vocab_size,
            f"stop_token_ids: {tok} is outside the vocabulary (size {vocab_size})",
        )
    require(
        0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
        f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}",
    )
    require(p.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    require(
        0 <= p.min_new_tokens <= p.max_new_tokens,
        f"min_new_tokens must be in [0, max_new_tokens={p.max_new_tokens}], got {p.min_new_tokens}",
    )
    require(p.n >= 1, f"n must be >= 1, got {p.n}")
    given = [kind for kind in CONSTRAINT_KINDS if getattr(p, kind) is not None]
    require(
        len(given) <= 1,
        f"give at most one of {', '.join(CONSTRAINT_KINDS)} (got {', '.join(given)})",
    )
    for kind in given:
        require(bool(getattr(p, kind)), f"{kind} must not be empty")
