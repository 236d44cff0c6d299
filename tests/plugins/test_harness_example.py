"""Testing a plugin's interceptors in-process with the actor test harness.

The harness runs one real actor (here the tokenizer) on its real runtime, codec
and interceptor chain; the test plays every other role. No other process starts.
It needs only actorlm installed: the fixtures come from ``actorlm.testing``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from actorlm.actors.runtime import RemoteError
from actorlm.extensions.interceptors import InterceptContext, Interceptor, Reject
from actorlm.messages.generate import GenerateRequest, TokenizedRequest
from actorlm.messages.sampling import SamplingParams
from actorlm.testing import HarnessFactory

# The plugin's interceptors: in a plugin's own tests, import them from its package.
MAX_NEW_TOKENS = 8


def refuse_forbidden(msg: GenerateRequest, ctx: InterceptContext) -> None:
    if msg.text is not None and "FORBIDDEN" in msg.text:
        raise Reject("my plugin: this prompt is not allowed")


def cap_max_new_tokens(msg: TokenizedRequest, ctx: InterceptContext) -> TokenizedRequest | None:
    if msg.sampling.max_new_tokens <= MAX_NEW_TOKENS:
        return None  # unchanged
    sampling = msgspec.structs.replace(msg.sampling, max_new_tokens=MAX_NEW_TOKENS)
    return msgspec.structs.replace(msg, sampling=sampling)


def test_interceptors_in_a_tokenizer(
    actorlm_harness: HarnessFactory, actorlm_tiny_model: Path
) -> None:
    chain = [
        Interceptor("tokenizer", GenerateRequest, "in", refuse_forbidden, "my-plugin"),
        # Meant for the scheduler's inbox; on the tokenizer's way out it sees the same message.
        Interceptor("tokenizer", TokenizedRequest, "out", cap_max_new_tokens, "my-plugin"),
    ]
    # A started tokenizer over the tiny model (config= gives another EngineConfig).
    h = actorlm_harness("tokenizer", interceptors=chain)

    async def main() -> None:
        ask = SamplingParams(max_new_tokens=100)
        await h.send(GenerateRequest(rid="a", text="hello", sampling=ask), sender="gateway")
        (sent,) = h.sent("scheduler")
        assert isinstance(sent, TokenizedRequest)
        assert sent.sampling.max_new_tokens == MAX_NEW_TOKENS
        assert sent.input_ids  # tokenized by the tiny model's tokenizer

        with pytest.raises(RemoteError, match="this prompt is not allowed") as info:
            await h.send(GenerateRequest(rid="b", text="FORBIDDEN"), sender="gateway")
        assert info.value.status == 400
        assert len(h.sent("scheduler")) == 1  # the refused request went no further

    actorlm_harness.run(main())  # on the harness's loop (not asyncio.run)
