"""The serving benchmark's arithmetic on recorded SSE streams; no live engine."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.serving_metrics import (
    RequestResult,
    SSEParser,
    count_output_tokens,
    percentile,
    replay_stream,
    summarize,
)
from bench.serving_report import markdown_table
from bench.workloads import WorkloadParams, build_workload, load_tokenizer, parse_range


def _chunk(text: str, finish: str | None = None) -> bytes:
    ev = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(ev)}\n\n".encode()


def _usage(prompt: int, completion: int) -> bytes:
    ev = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
    return f"data: {json.dumps(ev)}\n\n".encode()


# A recorded stream: (seconds after send, bytes as read from the socket).
RECORDED: list[tuple[float, bytes]] = [
    (0.010, b": keep-alive\n\n"),
    (0.020, _chunk("")),  # an empty first chunk is not the first token
    (0.250, _chunk(" Hello")),
    (0.300, _chunk(" world")[:17]),  # one event split across two reads
    (0.310, _chunk(" world")[17:]),
    (0.400, _chunk(",") + _chunk(" again")),  # two events in one read
    (0.520, _chunk("!", finish="length")),
    (0.530, _usage(7, 99)),
    (0.540, b"data: [DONE]\n\n"),
]


def _replay(start: float = 100.0) -> RequestResult:
    stream = [(start + t, data) for t, data in RECORDED]
    return replay_stream(stream, RequestResult(prompt_tokens=7, expected_output_tokens=5), start)


def test_percentile_matches_numpy_linear() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_sse_parser_handles_fragments_comments_and_crlf() -> None:
    p = SSEParser()
    assert p.feed(b': comment\r\n\r\nevent: x\ndata: {"a"') == []
    assert p.feed(b": 1}\r\n\r\ndata: [DONE]") == [{"a": 1}]
    assert p.close() == ["[DONE]"]
    assert p.feed(b"data: not json\n\ndata: 3\n") == []  # unparsable / non-object payloads


def test_ttft_itl_e2e_from_recorded_stream() -> None:
    r = _replay()
    assert r.ok and r.error == ""
    assert r.text == " Hello world, again!"
    assert r.ttft == pytest.approx(0.250)
    # gaps between chunks with text; the two events of one read share one timestamp
    assert r.itl == pytest.approx([0.060, 0.090, 0.0, 0.120])
    assert r.e2e == pytest.approx(0.540)
    assert r.chunks == 5
    assert r.finish_reason == "length"
    assert (r.server_prompt_tokens, r.server_output_tokens) == (7, 99)


def test_output_tokens_are_counted_with_the_tokenizer_not_the_server(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    r = _replay()
    count_output_tokens([r], lambda s: tok.encode(s, add_special_tokens=False))
    assert r.output_tokens == len(tok.encode(" Hello world, again!", add_special_tokens=False))
    assert 3 <= r.output_tokens <= 8 and r.server_output_tokens == 99
    assert r.tpot == pytest.approx((0.540 - 0.250) / (r.output_tokens - 1))


def test_failed_and_empty_streams() -> None:
    empty = replay_stream([(1.0, b"data: [DONE]\n\n")], RequestResult(5, 5), 0.0)
    assert not empty.ok and empty.error == "empty stream"
    err = b'data: {"error": {"message": "boom"}}\n\n'
    bad = replay_stream([(1.0, err)], RequestResult(5, 5), 0.0)
    assert not bad.ok and bad.error == "boom"


def test_summarize_throughput_and_percentiles() -> None:
    results = []
    for i in range(4):  # four requests of 10 output tokens each, staggered by 1 s
        start = float(i)
        stream = [(start + 0.5 + 0.1 * k, _chunk("x")) for k in range(10)]
        r = replay_stream(stream, RequestResult(prompt_tokens=20, expected_output_tokens=10), start)
        r.output_tokens = 10
        results.append(r)
    results.append(RequestResult(20, 10, error="HTTP 500"))
    s = summarize(results)
    # window: first send at 0.0, last end at 3.0 + 0.5 + 0.9 = 4.4
    assert s["duration_s"] == pytest.approx(4.4)
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["HTTP 500"])
    assert s["request_throughput"] == pytest.approx(4 / 4.4)
    assert s["output_throughput"] == pytest.approx(40 / 4.4)
    assert s["total_throughput"] == pytest.approx(120 / 4.4)
    assert s["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2e_ms"]["p90"] == pytest.approx(1400.0)
    assert summarize(results, duration=2.0)["output_throughput"] == pytest.approx(20.0)


def test_markdown_table_ratios_against_actorlm() -> None:
    def level(c: int, out_tps: float, ttft: float) -> dict[str, Any]:
        stat = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
        summary = {
            "completed": 8,
            "failed": 0,
            "request_throughput": 1.0,
            "output_throughput": out_tps,
            "total_throughput": 2 * out_tps,
            "ttft_ms": stat,
            "itl_ms": stat,
            "tpot_ms": stat,
            "e2e_ms": stat,
            "output_tokens": 512,
            "expected_output_tokens": 512,
        }
        return {"concurrency": c, "request_rate": None, "summary": summary}

    data = {
        "engines": {
            "actorlm": {"label": "actorlm", "note": "", "levels": [level(8, 300.0, 50.0)]},
            "llamacpp": {
                "label": "llama.cpp",
                "note": "one at a time",
                "levels": [level(8, 100.0, 400.0)],
            },
            "vllm": {"label": "vLLM", "note": "", "skipped": "no venv"},
        }
    }
    md = markdown_table(data)
    row = next(line for line in md.splitlines() if line.startswith("| llama.cpp[1]"))
    assert "| 3.00× | 8.00× |" in row
    assert "[1] llama.cpp: one at a time" in md
    assert "skipped: no venv" in md
    widths = {line.count("|") for line in md.splitlines() if line.startswith("|")}
    assert len(widths) == 1  # every row has the header's columns


def test_workloads_are_seeded_and_sized(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(tokenizer_dir)
    assert parse_range("64") == (64, 64) and parse_range("200:300") == (200, 300)
    p = WorkloadParams(dataset="random", num_prompts=6, seed=3, input_len=(100, 120))
    a, b = build_workload(tok, p), build_workload(tok, p)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    for r in a.requests:
        assert r.prompt_tokens == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 95 <= r.prompt_tokens <= 125 and r.output_tokens == 64

    sp = build_workload(
        tok,
        WorkloadParams(
            dataset="shared-prefix",
            num_prompts=8,
            num_groups=2,
            system_len=200,
            question_len=(10, 20),
        ),
    )
    prefixes = {r.prompt.split("\nUser:")[0] for r in sp.requests}
    assert len(sp.requests) == 8 and len(prefixes) == 2

    chat = build_workload(
        tok,
        WorkloadParams(
            dataset="chat", num_prompts=6, turns=3, user_len=(10, 20), output_len=(8, 8)
        ),
    )
    assert [len(c) for c in chat.conversations] == [3, 3]
    for conv in chat.conversations:
        for prev, nxt in zip(conv[:-1], conv[1:], strict=True):
            assert nxt.prompt.startswith(prev.prompt) and nxt.prompt_tokens > prev.prompt_tokens


def test_no_level_repeats_another_levels_prompts(tokenizer_dir: Path) -> None:
    """One seed for all levels made c=8's first 12 random prompts c=1's 12 (and c=4's
    shared-prefix requests c=1's, whole): every engine's prefix cache served them. Each
    level now draws its own, the same for every engine."""
    from bench.serving import level_workloads, parse_args

    tok = load_tokenizer(tokenizer_dir)
    for dataset in ("random", "shared-prefix"):
        args = parse_args(["--dataset", dataset, "--system-len", "64", "--input-len", "20:30"])
        levels = [(1, None), (8, None), (32, None)]
        runs = [level_workloads(tok, args, levels) for _ in range(2)]
        assert [[r.prompt for r in w.requests] for w in runs[0]] == [
            [r.prompt for r in w.requests] for w in runs[1]
        ]  # the same for every engine
        sizes = [len(w.requests) for w in runs[0]]
        assert sizes == [12, 24, 96]
        seen: set[str] = set()
        for w in runs[0]:
            prompts = {r.prompt for r in w.requests}
            assert not prompts & seen, dataset
            seen |= prompts


def test_run_level_against_a_fake_streaming_server() -> None:
    from aiohttp import web

    from bench.serving_client import run_level, wait_ready
    from bench.workloads import BenchRequest, Workload

    seen: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            await resp.write(_chunk(f" t{k}"))
        await resp.write(_usage(3, body["max_tokens"]) + b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        try:
            model = await wait_ready(url, ("/v1/models",), 10)
            wl = Workload(
                WorkloadParams(), [[BenchRequest(f"p{i}", 3, 4, conversation=i)] for i in range(6)]
            )
            run = await run_level(
                url, model, wl, lambda n: {"ignore_eos": True}, concurrency=2, progress=False
            )
            return model, run
        finally:
            await runner.cleanup()

    model, run = asyncio.run(main())
    assert model == "fake"
    assert len(run.results) == 6 and all(r.ok for r in run.results)
    assert all(r.text == " t0 t1 t2 t3" and len(r.itl) == 3 for r in run.results)
    assert all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in seen)
    assert {b["model"] for b in seen} == {"fake"}
