"""The native API (SGLang shapes), the control endpoints and /metrics, against ``actorlm serve``."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from actorlm.gpu.kernels import native

from .conftest import Server
from .test_errors import call

pytestmark = pytest.mark.timeout(300)


def test_generate_text_and_ids(server: Server) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "rid": "native-1"}  # fmt: skip
    status, out, _ = call(server, "POST", "/generate", json=body)
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["id"] == "native-1" and meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == 4 == len(out["output_ids"]) and meta["prompt_tokens"] > 0
    assert len(meta["output_token_logprobs"]) == 4 and all(
        len(t) == 2 for t in meta["output_top_logprobs"]
    )
    status, again, _ = call(
        server,
        "POST",
        "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
    )
    assert status == 200 and len(again["output_ids"]) == 2


def test_generate_stream_is_cumulative(server: Server) -> None:
    async def main() -> str:
        body = {
            "text": "Hi",
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        }
        async with (
            aiohttp.ClientSession(headers=server.headers) as session,
            session.post(f"{server.url}/generate", json=body) as resp,
        ):
            return await resp.text()

    raw = asyncio.run(main())
    assert raw.endswith("data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request(server: Server) -> None:
    async def main() -> dict:
        body = {
            "text": "Go on",
            "rid": "to-abort",
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        }
        async with aiohttp.ClientSession(headers=server.headers) as session:
            gen = asyncio.create_task(session.post(f"{server.url}/generate", json=body))
            await asyncio.sleep(1.0)
            async with session.post(
                f"{server.url}/abort_request", json={"rid": "to-abort"}
            ) as resp:
                assert resp.status == 200
            resp = await asyncio.wait_for(gen, 30)
            return await resp.json()

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 1500


def test_info_endpoints(server: Server) -> None:
    status, info, _ = call(server, "GET", "/get_model_info")
    assert (
        status == 200
        and info["served_model_name"] == server.model
        and info["max_model_len"] == 2048
    )
    status, info, _ = call(server, "GET", "/get_server_info")
    assert status == 200 and info["config"]["server"]["api_key"] == "***"
    assert {"scheduler", "cache_manager"} <= set(info["stats"])
    # which dtype and instruction set run: "auto" resolved, the kernels' ISA named
    assert info["config"]["model"]["dtype"] in ("float32", "bfloat16")
    assert info["config"]["model"]["dtype"] == info["platform"]["dtype_auto"]
    assert info["platform"]["kernel_isa"] in {i.name for i in native.ISAS}
    assert call(server, "GET", "/health_generate")[0] == 200
    for path in ("/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, body, _ = call(server, "POST", path, json={"lora_name": "a", "lora_path": "/x"})
        assert status == 400 and "--enable-lora" in body["error"]["message"]
        assert body["error"]["code"] == "lora_disabled"  # the call's code, as a plain string


def test_metrics(server: Server) -> None:
    call(server, "POST", "/v1/completions", json={"prompt": "metrics", "max_tokens": 3})
    status, text, headers = call(server, "GET", "/metrics", headers={})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")

    def value(name: str) -> float:
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert match, f"{name} missing from /metrics"
        return float(match.group(1))

    assert value("actorlm_time_to_first_token_seconds_count") >= 1
    assert value("actorlm_e2e_request_latency_seconds_count") >= 1
    assert value("actorlm_inter_token_latency_seconds_count") >= 1
    assert value("actorlm_generation_tokens_total") >= 3
    assert value("actorlm_prompt_tokens_total") >= 1
    assert value("actorlm_kv_pages_total") > 0
    assert value("actorlm_num_requests_running") == 0
    for name in (
        "actorlm_num_requests_waiting",
        "actorlm_kv_pages_used",
        "actorlm_prefix_cache_hit_rate",
    ):
        value(name)
    assert re.search(r'actorlm_http_requests_total\{route="/v1/completions",status="200"\} ', text)
    assert re.search(r'actorlm_requests_finished_total\{finish_reason="length"\} ', text)


def test_the_scheduler_logs_its_batches(server: Server) -> None:
    """SGLang's batch lines in the server's log: one for the step that computed the
    prompt, and a decode line at least every 40 decode steps, with the load and speed."""
    before = len(server.log_text())
    body = {"prompt": "batch lines in the log", "max_tokens": 45, "ignore_eos": True}
    status, out, _ = call(server, "POST", "/v1/completions", json={**body, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 45
    text = server.log_text()[before:]
    num = r"([\d.]+)"
    prefill = re.findall(
        rf"Prefill batch\. #new-seq: {num}, #new-token: {num}, #cached-token: {num}, token "
        rf"usage: {num}, #running-req: {num}, #queue-req: {num}, step: {num} ms",
        text,
    )
    # this request's prompt, computed in one step (another test's request may share it)
    prompt = out["usage"]["prompt_tokens"]
    rows = [[float(v) for v in line] for line in prefill]
    mine = [r for r in rows if r[1] + r[2] >= prompt]
    assert mine, text[-3000:]
    seqs, new, cached, usage, running, queued, ms = mine[0]
    assert seqs >= 1 and new >= 1 and running >= 1 and queued >= 0
    assert 0 <= usage < 1 and ms > 0  # usage: of a pool far larger than one request
    decode = re.findall(
        rf"Decode batch\. #running-req: {num}, #token: {num}, token usage: {num}, "
        rf"gen throughput \(token/s\): {num}, #queue-req: {num}, step: {num} ms",
        text,
    )
    assert decode, text[-3000:]
    running, tokens, usage, throughput, queued, ms = map(float, decode[0])
    assert running >= 1 and tokens > prompt and queued >= 0
    assert 0 <= usage < 1 and throughput > 0 and ms > 0
