"""The native API (SGLang's names and shapes): /generate, and the control endpoints."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from ..messages.generate import FinishReason, GenerateRequest, TextDelta, TokenLogprob
from ..messages.sampling import SamplingParams
from .body import read_json
from .errors import ApiError
from .params import Fields, checked_sampling, fan_out, native_sampling
from .state import STATE, GatewayState
from .streams import Fanout, SseWriter, delta_error
from .structured import native_constraint

__all__ = ["parse_generate", "routes"]

HEALTH_GENERATE_TIMEOUT_S = 60.0


@dataclass
class NativeJob:
    rid: str
    stream: bool
    return_logprob: bool
    reqs: list[GenerateRequest]
    start: float = field(default_factory=time.monotonic)


def parse_generate(body: Any, state: GatewayState) -> NativeJob:
    f = Fields(body)
    text, ids = f.raw("text"), f.raw("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "send exactly one of 'text' and 'input_ids'", param="text")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise ApiError(
            400, "batched /generate is not supported; send one prompt per request", param="text"
        )
    prompt: dict[str, Any] = (
        {"text": f.str("text")} if text is not None else {"input_ids": f.int_list("input_ids")}
    )
    if "input_ids" in prompt and not prompt["input_ids"]:
        raise ApiError(400, "'input_ids' must not be empty", param="input_ids")
    lora = state.adapter_for(f.str("lora_path"), param="lora_path")
    if lora is not None:
        prompt["lora_path"] = lora
    rid = f.str("rid") or uuid.uuid4().hex
    return_logprob = bool(f.bool("return_logprob", False))
    top = f.int("top_logprobs_num", 0) or 0
    sp = f.object("sampling_params")
    sampling = native_sampling(sp)
    sampling = msgspec.structs.replace(
        sampling,
        logprobs=return_logprob,
        top_logprobs=top if return_logprob else 0,
        **(native_constraint(sp) if sp is not None else {}),
    )
    sampling = checked_sampling(sampling, state.limits)
    limit = state.config.server.max_n
    reqs = fan_out(rid, sampling, [prompt], sampling.n, limit=limit, bare_single=True)
    return NativeJob(
        rid=rid, stream=bool(f.bool("stream", False)), return_logprob=return_logprob, reqs=reqs
    )


@dataclass
class NativeOutput:
    rid: str
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: TextDelta | None = None

    def add(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.last = delta

    def render(self, job: NativeJob) -> dict[str, Any]:
        last = self.last
        finish: dict[str, Any] | None = None
        usage = last.usage if last is not None else None
        if last is not None and last.finish_reason is not None:
            finish = {"type": last.finish_reason}
            if last.finish_reason == FinishReason.STOP:
                finish["matched"] = last.matched_stop
            elif last.finish_reason == FinishReason.LENGTH:
                finish["length"] = len(self.ids)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else len(self.ids),
            "cached_tokens": usage.cached_tokens if usage else 0,
            "e2e_latency": time.monotonic() - job.start,
        }
        if last is not None and last.grammar_backend:
            meta["grammar_backend"] = last.grammar_backend
        if job.return_logprob:
            meta["output_token_logprobs"] = [
                [lp.logprob, lp.token_id, lp.token] for lp in self.logprobs
            ]
            meta["output_top_logprobs"] = [
                [[v, i, t] for t, i, v in lp.top] for lp in self.logprobs
            ]
        return {"text": "".join(self.text), "output_ids": list(self.ids), "meta_info": meta}


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_generate(await read_json(request, state.config.server.max_body_bytes), state)
    outs = [NativeOutput(req.rid) for req in job.reqs]
    async with state.fanout(job.reqs) as fan:
        sse: SseWriter | None = None
        async for index, delta in fan:
            if delta.finish_reason == FinishReason.ERROR:
                if sse is None:
                    raise delta_error(delta)
                await sse.send(delta_error(delta).payload())
                return await sse.done()
            outs[index].add(delta)
            if job.stream:
                if sse is None:
                    sse = await SseWriter.open(request)
                if delta.text or delta.token_ids or delta.finish_reason:
                    # Cumulative text, as SGLang streams it.
                    await sse.send({**outs[index].render(job), "index": index})
        if sse is not None:
            return await sse.done()
    rendered = [out.render(job) for out in outs]
    return web.json_response(rendered[0] if len(rendered) == 1 else rendered)


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    f = Fields(await read_json(request, state.config.server.max_body_bytes))
    client = state.engine()
    rid, abort_all = f.str("rid", ""), bool(f.bool("abort_all", False))
    if not rid and not abort_all:
        raise ApiError(400, "send 'rid' (or 'abort_all': true)", param="rid")
    # An OpenAI request's choices run as "<id>-<i>": its id aborts them all.
    targets = {r for r in client.actor.streams if abort_all or r == rid or r.startswith(f"{rid}-")}
    if rid and not abort_all:
        targets.add(rid)
    await asyncio.gather(*(client.abort(r) for r in sorted(targets)))
    return web.json_response({"success": True, "aborted": sorted(targets)})


async def flush_cache(request: web.Request) -> web.Response:
    ok = await request.app[STATE].engine().flush_cache()
    message = "Cache flushed." if ok else "Cache not flushed: requests are running."
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "model_path": state.config.model.path,
            "tokenizer_path": state.config.model.path,
            "served_model_name": state.model_name,
            "is_generation": True,
            "max_model_len": state.limits.max_model_len,
            "vocab_size": state.limits.vocab_size,
            "model": _jsonable(state.model_facts),
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = msgspec.to_builtins(state.config)
    config["server"]["api_key"] = "***" if state.config.server.api_key else ""
    info: dict[str, Any] = {
        "version": _version(),
        "ready": state.ready,
        "draining": state.draining,
        "served_model_name": state.model_name,
        "platform": state.model_facts.get("platform"),  # the worker's Platform.describe()
        "config": config,
        "in_flight": 0,
        "stats": {},
    }
    if state.client is not None and state.ready:
        info["in_flight"] = state.client.in_flight
        info["stats"] = _jsonable(await state.client.stats())
    return web.json_response(info)


async def drain(request: web.Request) -> web.Response:
    """Stop admitting (every new request 503, ``/health`` "draining"), let the requests
    in flight finish within ``--shutdown-timeout``, then stop the server (as SIGTERM)."""
    state = request.app[STATE]
    in_flight = state.client.in_flight if state.client is not None else 0
    if not state.draining and state.request_stop is not None:
        state.request_stop("POST /drain")
    state.draining = True
    timeout = state.config.server.drain_timeout_s
    return web.json_response(
        {"draining": True, "in_flight": in_flight, "shutdown_timeout_s": timeout}
    )


async def health(request: web.Request) -> web.Response:
    """200 while every pipeline actor is alive; else 503 saying why, naming the roles
    that are down (as this gateway's liveness tracking sees them right now)."""
    state = request.app[STATE]
    down = state.down_roles()
    if state.ready and not state.draining and not down:
        return web.json_response({"status": "ok"})
    status = "draining" if state.draining else ("failed" if state.startup_error else "loading")
    body: dict[str, Any] = {"status": status}
    if state.ready and down and not state.draining:
        body = {"status": "degraded", "down": down}
    return web.json_response(body, status=503, headers={"Retry-After": "2"})


async def health_generate(request: web.Request) -> web.Response:
    """One real token through tokenizer, scheduler, cache manager and worker."""
    state = request.app[STATE]
    client = state.engine()
    req = GenerateRequest(
        rid=f"health-{uuid.uuid4().hex[:12]}",
        text="Hi",
        sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
    )

    async def one_token() -> None:
        async with Fanout(client, [req], state.metrics) as fan:
            async for _index, delta in fan:
                if delta.finish_reason == FinishReason.ERROR:
                    raise ApiError(
                        503,
                        f"health check failed: {delta.error}",
                        code="unhealthy",
                        headers={"Retry-After": "2"},
                    )

    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(
            503,
            f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s",
            code="unhealthy",
            headers={"Retry-After": "2"},
        ) from None
    return web.json_response({"status": "ok"})


def _version() -> str:
    try:
        return importlib.metadata.version("actorlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _jsonable(value: Any) -> Any:
    """Actor stats may hold tuples or numpy scalars; JSON needs plain types."""
    return msgspec.json.decode(msgspec.json.encode(value, enc_hook=str))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/generate", generate),
        web.post("/abort_request", abort_request),
        web.post("/flush_cache", flush_cache),
        web.post("/drain", drain),
        web.get("/get_model_info", get_model_info),
        web.get("/get_server_info", get_server_info),
        web.get("/health", health),
        web.get("/health_generate", health_generate),
    ]
