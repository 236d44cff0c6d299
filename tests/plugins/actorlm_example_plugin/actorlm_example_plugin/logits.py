"""A logit processor, chosen per request: ``SamplingParams(logit_processors=[
LogitProcessorSpec(name="example_force_token", params={"token_id": 42})])``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from actorlm.gpu.logit_processors import LogitProcessor

__all__ = ["ForceToken"]


class ForceToken(LogitProcessor):
    """Every sampled token is ``params["token_id"]``."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        token = params.get("token_id")
        if set(params) != {"token_id"} or not isinstance(token, int) or token < 0:
            raise ValueError("example_force_token takes exactly {'token_id': int >= 0}")
        self.token_id = token

    def check_vocab(self, vocab_size: int) -> None:
        if self.token_id >= vocab_size:
            raise ValueError(f"example_force_token: token {self.token_id} >= vocab {vocab_size}")

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        logits.fill_(float("-inf"))
        logits[self.token_id] = 0.0
        return logits
