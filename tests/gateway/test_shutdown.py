"""SIGTERM: the stream in flight finishes (drain), then every actor process is gone.

Runs after every other gateway test (``stops_shared_server``): it stops the package's
shared server.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from .conftest import Server, alive, child_pids

pytestmark = [pytest.mark.timeout(300), pytest.mark.stops_shared_server]


def test_sigterm_drains_then_exits_without_orphans(server: Server) -> None:
    kids = child_pids(server.proc.pid)
    assert len(kids) >= 4  # one process per pipeline actor

    async def stream_through_shutdown() -> str:
        body = {
            "model": server.model,
            "prompt": "Drain",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            aiohttp.ClientSession(headers=server.headers) as session,
            session.post(f"{server.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            await resp.content.readline()
            server.proc.send_signal(signal.SIGTERM)
            return await resp.text()

    tail = asyncio.run(stream_through_shutdown())
    assert tail.endswith("data: [DONE]\n\n")
    assert '"finish_reason":"length"' in tail  # drained, not cut off
    assert server.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in kids if alive(pid)], "actor processes outlived the server"
