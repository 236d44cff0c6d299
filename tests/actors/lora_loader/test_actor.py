"""The lora_loader actor alone (the harness plays the gateway, the scheduler and the
worker): adapters from --lora-paths and by request, weights to the worker as tensor
frames, references, slots and their eviction, unloads that wait, and peers that die."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from actorlm.actors.lora_loader.actor import LoraLoaderActor
from actorlm.actors.lora_loader.peft import read_adapter
from actorlm.actors.runtime import RemoteError
from actorlm.actors.runtime.harness import ActorHarness, check_inbox
from actorlm.config import EngineConfig, LoraConfig, ModelConfig
from actorlm.gpu.lora.targets import BaseShapes
from actorlm.gpu.model_info import load_model_info
from actorlm.messages.envelope import Codec, Envelope
from actorlm.messages.errors import ErrorCode
from actorlm.messages.lora import (
    ListLoraAdapters,
    LoadLoraAdapter,
    LoadLoraSlot,
    LoraAcquire,
    LoraAdapterInfo,
    LoraAdapterList,
    LoraSlotsChanged,
    LoraStep,
    LoraStepResult,
    UnloadLoraAdapter,
)

Run = Callable[[ActorHarness, list[LoadLoraSlot]], Awaitable[None]]


def run(tiny_llama: Path, adapters: dict[str, Path], body: Run, **lora: Any) -> None:
    specs = [f"sql={adapters['sql']}", f"chat={adapters['chat']}:pinned"]
    cfg = LoraConfig(lora_paths=specs, max_loras_per_batch=2, max_lora_rank=16, **lora)
    config = EngineConfig(model=ModelConfig(path=str(tiny_llama)), lora=cfg)

    async def main() -> None:
        loads: list[LoadLoraSlot] = []
        async with ActorHarness(LoraLoaderActor(config)) as h:
            h.on("worker", LoadLoraSlot, loads.append)
            await h.peer_up("worker")  # pinned adapters go to their slot once it is up
            await body(h, loads)

    asyncio.run(main())


async def step(h: ActorHarness, **kw: Any) -> LoraStepResult:
    reply = await h.request(LoraStep(**kw), sender="scheduler")
    await h.settle()
    assert isinstance(reply, LoraStepResult)
    return reply


async def adapters(h: ActorHarness) -> dict[str, LoraAdapterInfo]:
    reply = await h.request(ListLoraAdapters(), sender="gateway")
    assert isinstance(reply, LoraAdapterList)
    return {a.name: a for a in reply.adapters}


def test_every_message_has_a_handler() -> None:
    check_inbox(LoraLoaderActor)


def test_startup_adapters_references_and_slot_loads(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    shapes = BaseShapes.from_info(load_model_info(tiny_llama))
    sql = read_adapter("sql", str(lora_adapters["sql"]), shapes, 16)

    async def body(h: ActorHarness, loads: list[LoadLoraSlot]) -> None:
        known = await adapters(h)
        chat_id, sql_id = known["chat"].lora_id, known["sql"].lora_id
        # the pinned adapter went to a slot once the worker was up; the scheduler heard
        assert [(m.slot, m.lora_id) for m in loads] == [(0, chat_id)]
        assert LoraSlotsChanged in h.sent_types("scheduler")
        got = await step(
            h, acquire=[LoraAcquire("r1", "sql"), LoraAcquire("r2", "nope")], wanted=[sql_id]
        )
        assert [(a.rid, a.lora_id) for a in got.acquired] == [("r1", sql_id)]
        (no,) = got.refused
        assert no.rid == "r2" and no.code == ErrorCode.NOT_FOUND
        assert "'nope' does not exist" in no.message and "chat, sql" in no.message
        assert got.ready == [chat_id]  # sql is on its way
        (part,) = loads[1:]
        assert part.slot == 1 and part.lora_id == sql_id and part.first and part.last
        for t in part.targets:  # the adapter's arrays, as they left the loader
            a, b = sql.targets[t.module]
            assert isinstance(t.a, np.ndarray) and np.array_equal(t.a, a)
            assert np.array_equal(t.b, b)
        frames = Codec().encode(Envelope(part.TAG, 1, "lora_loader"), part)
        assert len(frames) == 2 + 2 * len(part.targets)  # raw tensor frames, not msgpack
        assert (await step(h)).ready == [chat_id, sql_id]
        assert (await adapters(h))["sql"].refs == 1

    run(tiny_llama, lora_adapters, body)


def test_eviction_keeps_pinned_and_running_adapters_and_unload_waits(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    async def body(h: ActorHarness, loads: list[LoadLoraSlot]) -> None:
        info = await h.request(
            LoadLoraAdapter(lora_name="all", lora_path=str(lora_adapters["all"])), sender="gateway"
        )
        assert isinstance(info, LoraAdapterInfo) and info.rank == 16 and info.slot == -1
        ids = {n: a.lora_id for n, a in (await adapters(h)).items()}
        await step(h, acquire=[LoraAcquire("r1", "sql")], wanted=[ids["sql"]])
        assert loads[-1].lora_id == ids["sql"]
        # all wants a slot: chat is pinned, sql runs: it waits
        await step(h, acquire=[LoraAcquire("r2", "all")], wanted=[ids["all"]], in_use=[ids["sql"]])
        assert loads[-1].lora_id == ids["sql"]
        # sql's request ended: its slot goes to all
        got = await step(h, release=["r1"], wanted=[ids["all"]])
        assert loads[-1].lora_id == ids["all"] and loads[-1].slot == 1
        assert ids["sql"] not in got.ready
        assert (await step(h)).ready == [ids["chat"], ids["all"]]
        # unloading all waits for r2, and hides the name at once
        unload = asyncio.ensure_future(
            h.request(UnloadLoraAdapter(lora_name="all"), sender="gateway")
        )
        await h.settle()
        assert not unload.done() and "all" not in {
            n for n, a in (await adapters(h)).items() if not a.unloading
        }
        refused = await step(h, acquire=[LoraAcquire("r3", "all")])
        assert refused.refused[0].rid == "r3"
        await step(h, release=["r2"])
        done = await unload
        assert isinstance(done, LoraAdapterInfo) and done.name == "all"
        assert "all" not in await adapters(h)
        stats = await h.request(ListLoraAdapters(), sender="gateway")
        assert isinstance(stats, LoraAdapterList) and stats.max_loras_per_batch == 2
        assert h.actor.stats()["slot_evictions"] == 1  # type: ignore[attr-defined]

    run(tiny_llama, lora_adapters, body)


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/nonexistent/adapter", 400, "no such directory"),
        ("FILE", 400, "not a directory"),
        ("SQL", 409, "already loaded"),
    ],
)
def test_refused_loads_say_why_and_the_loader_keeps_serving(
    tiny_llama: Path, lora_adapters: dict[str, Path], path: str, status: int, says: str
) -> None:
    async def body(h: ActorHarness, loads: list[LoadLoraSlot]) -> None:
        where = {"FILE": str(tiny_llama / "config.json"), "SQL": str(lora_adapters["sql"])}
        name = "sql" if path == "SQL" else "new"
        with pytest.raises(RemoteError, match=says) as info:
            await h.request(
                LoadLoraAdapter(lora_name=name, lora_path=where.get(path, path)), sender="gateway"
            )
        assert info.value.status == status
        assert set(await adapters(h)) == {"sql", "chat"}
        with pytest.raises(RemoteError, match="no LoRA adapter named 'new'") as gone:
            await h.request(UnloadLoraAdapter(lora_name="new"), sender="gateway")
        assert gone.value.status == 404

    run(tiny_llama, lora_adapters, body)


def test_dead_workers_and_schedulers_leave_nothing_behind(
    tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    async def body(h: ActorHarness, loads: list[LoadLoraSlot]) -> None:
        ids = {n: a.lora_id for n, a in (await adapters(h)).items()}
        await step(h, acquire=[LoraAcquire("r1", "sql")], wanted=[ids["sql"]])
        assert len((await step(h)).ready) == 2
        h.clear("scheduler")
        await h.peer_down("worker")  # its slots are gone
        assert (await step(h)).ready == [] and LoraSlotsChanged in h.sent_types("scheduler")
        await h.peer_up("worker")  # the pinned adapter goes back at once
        assert loads[-1].lora_id == ids["chat"]
        assert (await step(h)).ready == [ids["chat"]]
        unload = asyncio.ensure_future(
            h.request(UnloadLoraAdapter(lora_name="sql"), sender="gateway")
        )
        await h.settle()
        assert not unload.done()
        await h.peer_down("scheduler")  # its requests, and their references, died with it
        assert isinstance(await unload, LoraAdapterInfo)
        assert h.actor.stats()["adapter_refs"] == 0  # type: ignore[attr-defined]

    run(tiny_llama, lora_adapters, body)
