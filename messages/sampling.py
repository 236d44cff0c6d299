"""Sampling parameters: one frozen struct shared by every actor that touches a request."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["LogitProcessorSpec", "SamplingParams"]


class LogitProcessorSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A registered logit processor chosen by name, with JSON-able parameters (never code)."""

    name: str
    params: dict[str, Any] = {}


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling. ``temperature == 0`` (or ``top_k == 1``) means greedy.

    Defaults follow SGLang's ``sampling_params`` names so native clients feel at home.
    """

    max_new_tokens: int = 128
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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1
