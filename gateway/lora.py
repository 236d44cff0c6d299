"""LoRA adapters over HTTP: loading and unloading them (SGLang's ``/load_lora_adapter``
and ``/unload_lora_adapter``, vLLM's ``/v1/...`` names for the same), and their model
cards for ``/v1/models``. The lora_loader actor owns the registry; these handlers
ask it and turn its refusals into OpenAI-shaped errors with their 4xx status.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from ..actors.runtime import ActorError
from ..messages.lora import LoraAdapterInfo
from .body import read_json
from .errors import ApiError, from_actor_error
from .params import Fields
from .state import STATE, GatewayState

__all__ = ["adapter_card", "adapter_cards", "routes"]


def _json(info: LoraAdapterInfo) -> dict[str, Any]:
    return msgspec.to_builtins(info)  # type: ignore[no-any-return]


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    f = Fields(await read_json(request, state.config.server.max_body_bytes))
    name, path = f.str("lora_name"), f.str("lora_path")
    pinned = bool(f.bool("pinned", False))
    if not name:
        raise ApiError(400, "send lora_name, the name requests will use", param="lora_name")
    if not path:
        raise ApiError(400, "send lora_path, the PEFT adapter's folder", param="lora_path")
    if name in state.aliases:  # requests naming it would get the base model
        raise ApiError(409, f"{name!r} names the base model", param="lora_name")
    client = state.engine()
    try:
        info = await client.load_lora(name, path, pinned)
    except ActorError as exc:
        raise from_actor_error(exc) from None
    message = f"LoRA adapter {name!r} loaded (rank {info.rank}, {', '.join(info.target_modules)})"
    return web.json_response({"success": True, "message": message, "adapter": _json(info)})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    f = Fields(await read_json(request, state.config.server.max_body_bytes))
    name = f.str("lora_name")
    if not name:
        raise ApiError(400, "send lora_name, the adapter to unload", param="lora_name")
    client = state.engine()
    try:
        info = await client.unload_lora(name)
    except ActorError as exc:
        raise from_actor_error(exc) from None
    message = f"LoRA adapter {name!r} unloaded"
    return web.json_response({"success": True, "message": message, "adapter": _json(info)})


def adapter_card(state: GatewayState, info: LoraAdapterInfo) -> dict[str, Any]:
    """An adapter as OpenAI lists a model: the base model is its parent (as vLLM does)."""
    return {
        "id": info.name,
        "object": "model",
        "created": 0,
        "owned_by": "actorlm",
        "root": info.path,
        "parent": state.model_name,
        "max_model_len": state.limits.max_model_len,
    }


async def adapter_cards(state: GatewayState) -> list[dict[str, Any]]:
    """Every adapter requests can name now ([] when LoRA is off, or its actor is down)."""
    if not state.config.lora.enabled or state.client is None or not state.ready:
        return []
    try:
        adapters = await state.client.lora_adapters()
    except ActorError:
        return []
    return [adapter_card(state, a) for a in adapters]


def routes() -> list[web.RouteDef]:
    return [
        web.post(f"{prefix}/{verb}_lora_adapter", handler)
        for prefix in ("", "/v1")
        for verb, handler in (("load", load_lora_adapter), ("unload", unload_lora_adapter))
    ]
