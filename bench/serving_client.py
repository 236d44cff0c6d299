"""Load generator: streams ``/v1/completions`` requests at a fixed concurrency or a Poisson rate."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.serving_metrics import RequestResult, SSEParser, StreamRecorder
from bench.workloads import BenchRequest, Workload

__all__ = ["LevelRun", "run_level", "send_one", "server_info", "wait_ready"]

ExtraBody = Callable[[int], dict[str, Any]]


@dataclass
class LevelRun:
    results: list[RequestResult] = field(default_factory=list)
    duration: float = 0.0
    timed_out: bool = False


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    model: str | None,
    req: BenchRequest,
    extra_body: ExtraBody,
    timeout: float = 600.0,
) -> RequestResult:
    """One streaming completion, timed chunk by chunk."""
    body: dict[str, Any] = {
        "prompt": req.prompt,
        "max_tokens": req.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body(req.output_tokens),
    }
    if model:
        body["model"] = model
    result = RequestResult(req.prompt_tokens, req.output_tokens, req.conversation, req.turn)
    parser = SSEParser()
    start = time.perf_counter()
    rec = StreamRecorder(result, start)
    try:
        async with session.post(
            url.rstrip("/") + "/v1/completions",
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return rec.finish(time.perf_counter(), f"HTTP {resp.status}: {text}")
            async for data in resp.content.iter_any():
                t = time.perf_counter()
                for ev in parser.feed(data):
                    rec.on_event(ev, t)
            for ev in parser.close():
                rec.on_event(ev, time.perf_counter())
    except (TimeoutError, aiohttp.ClientError) as e:
        return rec.finish(time.perf_counter(), f"{type(e).__name__}: {e}")
    return rec.finish(time.perf_counter())


async def run_level(
    url: str,
    model: str | None,
    workload: Workload,
    extra_body: ExtraBody,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    time_limit: float | None = None,
    progress: bool = True,
    desc: str = "",
) -> LevelRun:
    """Run every conversation of ``workload``; requests within a conversation go in turn.

    ``concurrency`` caps requests in flight; ``request_rate`` (req/s) starts
    conversations at Poisson arrival times instead (both may be given).
    ``time_limit`` stops the level early (unfinished requests count as failed).
    """
    from tqdm.auto import tqdm

    total = len(workload.requests)
    bar = tqdm(total=total, desc=desc, disable=not progress, dynamic_ncols=True)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    run = LevelRun()
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)

    async def conversation(
        session: aiohttp.ClientSession, conv: list[BenchRequest], delay: float
    ) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        for k, req in enumerate(conv):
            if sem is not None:
                async with sem:
                    res = await send_one(session, url, model, req, extra_body)
            else:
                res = await send_one(session, url, model, req, extra_body)
            run.results.append(res)
            bar.update(1)
            if not res.ok:  # later turns build on this one: count them as failed too
                for later in conv[k + 1 :]:
                    run.results.append(
                        RequestResult(
                            later.prompt_tokens,
                            later.output_tokens,
                            later.conversation,
                            later.turn,
                            error="skipped: an earlier turn failed",
                        )
                    )
                    bar.update(1)
                break

    delays: list[float] = []
    t = 0.0
    for _ in workload.conversations:
        delays.append(t)
        if request_rate and request_rate > 0 and request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.perf_counter()
        tasks = [
            asyncio.ensure_future(conversation(session, c, d))
            for c, d in zip(workload.conversations, delays, strict=True)
        ]
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        if pending:
            run.timed_out = True
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for d in done:
            if d.exception() is not None:
                raise d.exception()  # type: ignore[misc]
        run.duration = time.perf_counter() - start
    bar.close()
    missing = total - len(run.results)
    for _ in range(missing):
        run.results.append(RequestResult(0, 0, ok=False, error="not finished within --time-limit"))
    return run


async def wait_ready(
    url: str, paths: tuple[str, ...], timeout: float, alive: Callable[[], bool] = lambda: True
) -> str | None:
    """Poll until one of ``paths`` answers 200; return the served model id if listed.

    Raises ``TimeoutError`` after ``timeout`` s, ``RuntimeError`` if ``alive()`` turns false.
    """
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the server process exited during start-up")
            for path in paths:
                try:
                    async with session.get(
                        url.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=5)
                    ) as r:
                        if r.status != 200:
                            continue
                        model = None
                        try:
                            async with session.get(
                                url.rstrip("/") + "/v1/models",
                                timeout=aiohttp.ClientTimeout(total=5),
                            ) as m:
                                if m.status == 200:
                                    data = (await m.json(content_type=None)).get("data") or []
                                    model = data[0].get("id") if data else None
                        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                            pass
                        return model
                except (TimeoutError, aiohttp.ClientError):
                    pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


async def server_info(url: str) -> dict[str, Any]:
    """actorlm's /get_server_info, cut to what says how it ran."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/get_server_info") as r:
        info = await r.json()
    keep = ("dtype", "quantization", "attention_backend", "platform", "num_threads")
    found: dict[str, Any] = {}

    def walk(d: Any) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                if k in keep and k not in found:
                    found[k] = v
                walk(v)

    walk(info)
    return found
