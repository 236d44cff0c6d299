"""The tokenizer's guards on chat templates and prompt size, on the real TokenizerActor
(in the harness, with a real tokenizer): a request's own template only when the
operator trusts requests, a time limit on every render with the loop free meanwhile,
and prompts too long to fit refused before tokenizing (issue 17)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from actorlm.actors.runtime.harness import ActorHarness
from actorlm.actors.tokenizer import TokenizerActor
from actorlm.config import EngineConfig, ModelConfig, ServerConfig
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import ChatMessage, GenerateRequest, TextBatch, TokenizedRequest

# ~2 s to render here (64M loop steps): past the tests' 0.5 s limit on any machine, yet
# finite. Its thread outlives the test (a render cannot be stopped), and an endless one
# held a core and the GIL for the rest of the suite's process: the GGUF tokenizer
# conversion in test_tokenization.py took ~80 s behind it instead of ~5.
SLOW = "{% for i in range(8000) %}{% for j in range(8000) %}{% endfor %}{% endfor %}"
HI = [ChatMessage(role="user", content="hi")]


def config(model: Path, **server: object) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(model), max_model_len=256),
        server=ServerConfig(**server),  # type: ignore[arg-type]
    )


async def outcome(h: ActorHarness, rid: str, timeout: float = 10.0) -> object:
    """What became of ``rid``: the TokenizedRequest passed on, or the error sent back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in h.sent("scheduler"):
            if isinstance(msg, TokenizedRequest) and msg.rid == rid:
                return msg
        for msg in h.sent("gateway"):
            if isinstance(msg, TextBatch) and msg.items[0].rid == rid:
                return msg.items[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"nothing became of {rid}")


def test_request_templates_need_the_operators_trust(tiny_llama: Path) -> None:
    async def main() -> None:
        async with ActorHarness(TokenizerActor(config(tiny_llama))) as h:
            kwargs = {"chat_template": "{{ messages[0].content }}"}
            req = GenerateRequest(rid="t", messages=HI, chat_template_kwargs=kwargs)
            await h.send(req, sender="gateway")
            got = await outcome(h, "t")
            assert got.error_code is ErrorCode.INVALID_REQUEST  # type: ignore[attr-defined]
            assert "--trust-request-chat-template" in got.error  # type: ignore[attr-defined]
            for key in ("add_generation_prompt", "messages", "tokenize"):
                bad = GenerateRequest(rid=key, messages=HI, chat_template_kwargs={key: 1})
                await h.send(bad, sender="gateway")
                got = await outcome(h, key)
                assert f"may not set {key}" in got.error  # type: ignore[attr-defined]

        trusted = config(tiny_llama, trust_request_chat_template=True)
        actor = TokenizerActor(trusted)
        async with ActorHarness(actor) as h:
            await h.send(
                GenerateRequest(rid="t", messages=HI, chat_template_kwargs=kwargs), sender="gateway"
            )
            got = await outcome(h, "t")
            assert isinstance(got, TokenizedRequest)  # rendered by the request's own template:
            assert got.input_ids == actor.tok.encode("hi", add_special_tokens=False)

    asyncio.run(main())


def test_a_slow_render_fails_alone_and_the_loop_keeps_serving(tiny_llama: Path) -> None:
    cfg = config(tiny_llama, trust_request_chat_template=True, chat_template_timeout_s=0.5)

    async def main() -> None:
        async with ActorHarness(TokenizerActor(cfg)) as h:
            slow = GenerateRequest(
                rid="slow", messages=HI, chat_template_kwargs={"chat_template": SLOW}
            )
            start = time.monotonic()
            await h.send(slow, sender="gateway", settle=False)
            await h.send(GenerateRequest(rid="quick", text="hello"), sender="gateway", settle=False)
            quick = await outcome(h, "quick")  # served while the slow render runs
            assert isinstance(quick, TokenizedRequest) and time.monotonic() - start < 0.5
            got = await outcome(h, "slow")
            assert "took longer than 0.5s" in got.error  # type: ignore[attr-defined]
            assert time.monotonic() - start < 2.0

    asyncio.run(main())


@pytest.mark.parametrize("field", ["text", "messages"])
def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(
    tiny_llama: Path, field: str
) -> None:
    cfg = config(tiny_llama, max_prompt_chars=100)

    async def main() -> None:
        async with ActorHarness(TokenizerActor(cfg)) as h:
            long = "word " * 40
            kw = (
                {"text": long}
                if field == "text"
                else {"messages": [ChatMessage(role="user", content=long)]}
            )
            await h.send(GenerateRequest(rid="long", **kw), sender="gateway")  # type: ignore[arg-type]
            got = await outcome(h, "long")
            assert got.error_code is ErrorCode.TOO_LARGE and "--max-prompt-chars" in got.error  # type: ignore[attr-defined]

    asyncio.run(main())
