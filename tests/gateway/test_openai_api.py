"""The OpenAI-compatible API through the real ``openai`` package, against ``actorlm serve``."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from .conftest import API_KEY, Server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_health_reported_loading_then_ready(server: Server) -> None:
    assert server.seen_loading, "/health must answer 503 while the actors start"
    assert f"actorlm serving {server.model} at {server.url}" in server.log_text()


def test_models(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].object == "model"


def test_completion_sync(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=5, temperature=0
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.created > 0
    assert out.model == server.model
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_completion_n_seed_and_logprobs(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(
        model=server.model, prompt="Once", max_tokens=4, n=3, seed=11, temperature=1.0, logprobs=2
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 12
    again = client.completions.create(
        model=server.model, prompt="Once", max_tokens=4, n=3, seed=11, temperature=1.0, logprobs=2
    )
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded: reproducible
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_sync_with_logprobs(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        user="tester",
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode()) for t in content)


def test_chat_stream_matches_non_stream(client: openai.OpenAI, server: Server) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_stream_stop_string(client: openai.OpenAI, server: Server) -> None:
    full = client.completions.create(model=server.model, prompt="The", max_tokens=6, temperature=0)
    stop = full.choices[0].text[3:6] or "zzz"
    pieces = list(
        client.completions.create(
            model=server.model, prompt="The", max_tokens=6, temperature=0, stop=[stop], stream=True
        )
    )
    text = "".join(p.choices[0].text for p in pieces)
    assert stop not in text
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_async_client_concurrent_streams(server: Server) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)

        async def one(i: int) -> str:
            stream = await aclient.completions.create(
                model=server.model, prompt=f"Number {i}", max_tokens=5, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert len(texts) == 3 and all(texts)


def test_sse_framing(server: Server) -> None:
    async def main() -> tuple[str, str]:
        async with aiohttp.ClientSession(headers=server.headers) as session:
            body = {"model": server.model, "prompt": "Hi", "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                return resp.headers["Content-Type"], await resp.text()

    ctype, raw = asyncio.run(main())
    assert ctype.startswith("text/event-stream")
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3
