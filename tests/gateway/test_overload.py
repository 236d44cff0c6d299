"""Overload sheds load honestly: --max-queued-requests is exact however many requests
arrive at once, every 429 and 503 says when to come back, and n is bounded before any
work is made (issue 17)."""

from __future__ import annotations

import asyncio

import aiohttp

from .conftest import MAX_QUEUED, Server
from .test_errors import call


def test_the_queue_limit_is_exact_under_a_burst(server: Server) -> None:
    async def one(session: aiohttp.ClientSession) -> tuple[int, str | None]:
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with session.post(f"{server.url}/v1/completions", json=body) as resp:
            retry = resp.headers.get("Retry-After")
            if resp.status == 200:
                await resp.content.readline()  # hold the place until every request was answered
                await asyncio.sleep(1.0)
            return resp.status, retry

    async def burst() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession(headers=server.headers) as session:
            return await asyncio.gather(*(one(session) for _ in range(3 * MAX_QUEUED)))

    answers = asyncio.run(burst())
    statuses = sorted(status for status, _ in answers)
    assert statuses.count(200) == MAX_QUEUED, statuses
    assert statuses.count(429) == 2 * MAX_QUEUED
    assert all(retry == "1" for status, retry in answers if status == 429)


def test_n_is_bounded_before_any_work(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "n": 10**6}
    status, payload, _ = call(server, "POST", "/v1/chat/completions", json=body)
    assert status == 400 and payload["error"]["param"] == "n"
    assert "at most 128" in payload["error"]["message"]
