"""``actorlm.Engine``: the Python API over the same actor processes ``serve`` runs.

    with Engine(model="/models/smollm2.gguf") as engine:
        out = engine.generate("What is the capital of France?", {"max_new_tokens": 32})
        print(out.text)

The engine runs its own event loop in a background thread, so the synchronous
API works anywhere; ``agenerate`` and ``stream`` are awaitable from any loop.
With ``deploy="cluster.toml"`` it connects to actors started elsewhere with
``actorlm actor ROLE --deploy cluster.toml`` instead of spawning its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from .actors.client import ClientActor, EngineClient, RequestFailed, pipeline_roles
from .actors.runtime import ActorError, ActorRuntime, RuntimeOptions
from .actors.runtime.supervisor import Launcher
from .config import EngineConfig
from .launch import Deployment, config_from_options, load_deployment, resolve_config
from .messages.errors import ErrorCode, code_for_status
from .messages.generate import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    TextDelta,
    TokenLogprob,
    Usage,
)
from .messages.sampling import SamplingParams, check_sampling

__all__ = ["Engine", "GenerateOutput"]

T = TypeVar("T")
Prompt = str | list[int] | list[dict[str, Any]] | list[ChatMessage]


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning_text: str = ""  # with --reasoning-parser and separate_reasoning=True
    grammar_backend: str | None = None  # the grammar backend of a constrained request


def _sampling(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return msgspec.convert(params, SamplingParams)


class Engine:
    def __init__(
        self,
        model: str = "",
        *,
        placement: str = "process",
        deploy: str | None = None,
        config: EngineConfig | None = None,
        start_timeout: float = 600.0,
        **options: Any,
    ) -> None:
        if deploy is not None:
            self._deployment: Deployment | None = load_deployment(deploy, config)
            base = self._deployment.config
        else:
            self._deployment = None
            base = config or EngineConfig()
        if model:
            options["path"] = model
        self.config = resolve_config(config_from_options(base, **options))
        self.placement = placement
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="actorlm-engine", daemon=True
        )
        self._thread.start()
        self._launcher: Launcher | None = None
        self._runtime: ActorRuntime | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self.client: EngineClient
        try:
            self._call(self._start(start_timeout))
        except BaseException:
            self.close()
            raise

    # -- lifecycle ------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, timeout: float) -> None:
        actor = ClientActor(self.config)
        if self._deployment is None:
            roles = list(pipeline_roles(self.config))
            self._launcher = Launcher(self.config, roles, placement=self.placement)
            await self._launcher.start(timeout)
            address = self._launcher.new_address(actor.role)
            transport = self._launcher.transport
            book = dict(self._launcher.book)
        else:
            from .actors.runtime.transport import ZmqTransport, free_port

            transport = ZmqTransport.for_deploy(self.config.deploy)
            address = f"tcp://127.0.0.1:{free_port()}"
            book = dict(self._deployment.addresses)
        self._runtime = ActorRuntime(
            actor,
            address,
            transport,
            RuntimeOptions.from_deploy(self.config.deploy, book=book),
        )
        if self._launcher is not None:
            self._launcher.attach(self._runtime)
        self._serve_task = asyncio.create_task(self._runtime.serve())
        await self._runtime.ready.wait()
        self.client = EngineClient(actor)
        if self._deployment is not None:
            await self._wait_for_actors(timeout)
        self.vocab_size = int((await self.client.info("worker")).get("vocab_size", 0))

    async def _wait_for_actors(self, timeout: float) -> None:
        from .messages.control import Ping

        assert self._runtime is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for role in pipeline_roles(self.config):
            while True:
                try:
                    await self._runtime.request(role, Ping(), timeout=1.0)
                    break
                except ActorError:
                    if loop.time() > deadline:
                        raise TimeoutError(
                            f"actor {role} did not answer within {timeout:g}s"
                        ) from None

    async def _stop(self) -> None:
        if self._runtime is not None:
            self._runtime.stop()
        if self._serve_task is not None:
            await asyncio.gather(self._serve_task, return_exceptions=True)
        if self._launcher is not None:
            await self._launcher.stop()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self._call(self._stop())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # -- generation -------------------------------------------------------------
    def _request(self, prompt: Prompt, sampling: SamplingParams, **kw: Any) -> GenerateRequest:
        lora = kw.pop("lora", None)
        if lora is not None:  # the adapter's name, as /generate's lora_path
            kw["lora_path"] = lora
        try:
            check_sampling(
                sampling, self.vocab_size
            )  # this edge's check, as HTTP's is the gateway's
        except ValueError as exc:
            raise RequestFailed(str(exc), ErrorCode.INVALID_REQUEST) from None
        rid = kw.pop("rid", None) or self.client.new_rid()
        if isinstance(prompt, str):
            return GenerateRequest(rid=rid, text=prompt, sampling=sampling, **kw)
        if prompt and isinstance(prompt[0], int):
            return GenerateRequest(rid=rid, input_ids=list(prompt), sampling=sampling, **kw)  # type: ignore[arg-type]
        messages = [
            m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage) for m in prompt
        ]
        return GenerateRequest(rid=rid, messages=messages, sampling=sampling, **kw)

    async def _collect(self, req: GenerateRequest) -> GenerateOutput:
        text: list[str] = []
        thought: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        async for d in self.client.generate(req):
            if d.error:
                raise RequestFailed(
                    d.error or "the request failed", d.error_code or ErrorCode.INTERNAL
                )
            text.append(d.text)
            thought.append(d.reasoning_text)
            ids.extend(d.token_ids)
            lps.extend(d.logprobs or [])
            if d.finish_reason is not None:
                usage = d.usage or Usage(0, len(ids), 0)
                return GenerateOutput(
                    "".join(text),
                    ids,
                    d.finish_reason,
                    usage,
                    d.matched_stop,
                    lps,
                    reasoning_text="".join(thought),
                    grammar_backend=d.grammar_backend,
                )
        raise RequestFailed("the stream ended without a finish")

    def generate(
        self,
        prompt: Prompt | list[Prompt],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        **kw: Any,
    ) -> Any:
        """Text, token ids or chat messages in; a GenerateOutput (or a list, for a list
        of prompts, run concurrently) out. A plain string is used as is; pass chat
        messages (``[{"role": "user", "content": ...}]``) for the chat template.
        ``lora="name"`` runs it with that LoRA adapter (loaded at start with
        ``lora_paths=[...]`` or with ``load_lora_adapter``)."""
        sampling = _sampling(sampling_params)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            reqs = [self._request(p, sampling, **kw) for p in prompt]  # type: ignore[arg-type]

            async def many() -> list[GenerateOutput]:
                return list(await asyncio.gather(*(self._collect(r) for r in reqs)))

            return self._call(many())
        return self._call(self._collect(self._request(prompt, sampling, **kw)))  # type: ignore[arg-type]

    def chat(
        self, content: str, sampling_params: SamplingParams | dict[str, Any] | None = None
    ) -> GenerateOutput:
        """One user turn through the model's chat template."""
        return self.generate([{"role": "user", "content": content}], sampling_params)  # type: ignore[no-any-return]

    async def agenerate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        **kw: Any,
    ) -> GenerateOutput:
        req = self._request(prompt, _sampling(sampling_params), **kw)
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._collect(req), self._loop)
        )

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        **kw: Any,
    ) -> AsyncIterator[TextDelta]:
        """Deltas as they come, on the caller's loop; leaving early aborts the request."""
        req = self._request(prompt, _sampling(sampling_params), **kw)
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[TextDelta | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for delta in self.client.generate(req):
                    caller.call_soon_threadsafe(queue.put_nowait, delta)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                caller.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                caller.call_soon_threadsafe(queue.put_nowait, None)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()

    def stats(self) -> dict[str, dict[str, Any]]:
        return self._call(self.client.stats())

    # -- LoRA adapters ------------------------------------------------------------
    def _lora_call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._call(coro)
        except ActorError as exc:
            raise RequestFailed(str(exc), code_for_status(exc.status)) from None

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        """Serve the PEFT adapter at ``path`` as ``name`` (RequestFailed, status 4xx,
        saying what is wrong when it cannot be); its description."""
        info = self._lora_call(self.client.load_lora(name, path, pinned))
        return msgspec.to_builtins(info)  # type: ignore[no-any-return]

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Stop serving ``name``; returns once the requests using it have finished."""
        return msgspec.to_builtins(self._lora_call(self.client.unload_lora(name)))  # type: ignore[no-any-return]

    def lora_adapters(self) -> list[dict[str, Any]]:
        return [msgspec.to_builtins(a) for a in self._lora_call(self.client.lora_adapters())]

    def flush_cache(self) -> bool:
        return self._call(self.client.flush_cache())
