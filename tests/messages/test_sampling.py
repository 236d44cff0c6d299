"""The ranges SamplingParams allows, checked where a request enters the engine."""

from __future__ import annotations

import pytest
from actorlm.messages.sampling import SamplingParams, check_sampling


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"logit_bias": {100: 1.0}}, "logit_bias token id 100"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"n": 0}, "n must be"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], message: str) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        check_sampling(params, 100)


def test_validation_accepts_defaults_and_edges() -> None:
    check_sampling(SamplingParams(), 100)
    check_sampling(
        SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, top_logprobs=20), 100
    )
