"""Testing a plugin's interceptors in-process with the actor test harness.

The harness runs one real actor (here the tokenizer) on its real runtime, codec
and interceptor chain; the test plays every other role. No other process starts.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from actorlm.actors.runtime import RemoteError
from actorlm.actors.runtime.harness import ActorHarness
from actorlm.actors.tokenizer import TokenizerActor
from actorlm.config import EngineConfig, ModelConfig
from actorlm.extensions.interceptors import (
    Interceptor,
    clear_interceptors,
    interceptors,
    register_interceptor,
)
from actorlm.messages.generate import GenerateRequest, TokenizedRequest
from actorlm.messages.sampling import SamplingParams


@pytest.fixture
def example_interceptors(plugin_site: Path) -> Iterator[ModuleType]:
    """The plugin's interceptor module. Importing it registers its interceptors in
    this process (its decorators run): they are taken out again afterwards."""
    before = interceptors()
    sys.path.insert(0, str(plugin_site))
    try:
        yield importlib.import_module("actorlm_example_plugin.interceptors")
    finally:
        sys.path.remove(str(plugin_site))
        clear_interceptors()
        for i in before:
            register_interceptor(i.role, i.msg_type, i.direction, i.fn, source=i.source)


def test_example_interceptors_in_a_tokenizer(
    example_interceptors: ModuleType, tiny_llama: Path
) -> None:
    plugin = example_interceptors
    chain = [
        Interceptor("tokenizer", GenerateRequest, "in", plugin.refuse_forbidden, "example"),
        # Meant for the scheduler's inbox; on the tokenizer's way out it sees the same message.
        Interceptor("tokenizer", TokenizedRequest, "out", plugin.cap_max_new_tokens, "example"),
    ]
    config = EngineConfig(model=ModelConfig(path=str(tiny_llama), max_model_len=2048))

    async def main() -> None:
        async with ActorHarness(TokenizerActor(config), interceptors=chain) as h:
            ask = SamplingParams(max_new_tokens=100)
            await h.send(GenerateRequest(rid="a", text="hello", sampling=ask), sender="gateway")
            (sent,) = h.sent("scheduler")
            assert isinstance(sent, TokenizedRequest)
            assert sent.sampling.max_new_tokens == plugin.MAX_NEW_TOKENS

            with pytest.raises(RemoteError, match="this prompt is not allowed") as info:
                await h.send(GenerateRequest(rid="b", text="FORBIDDEN"), sender="gateway")
            assert info.value.status == 400
            assert len(h.sent("scheduler")) == 1  # the refused request went no further

    asyncio.run(main())
