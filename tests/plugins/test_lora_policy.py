"""``actorlm actor lora_loader`` alone, in a process of its own, with the example plugin
installed and its LoRA eviction policy chosen by name. This test plays the scheduler
and the worker (real ZMQ sockets): the plugin's policy picks the slot to give up."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from actorlm.actors.runtime import Actor, ActorError, ActorRuntime, RuntimeOptions, handles
from actorlm.actors.runtime.transport import ZmqTransport
from actorlm.config import DeployConfig, EngineConfig
from actorlm.messages.envelope import Envelope
from actorlm.messages.lora import (
    ListLoraAdapters,
    LoadLoraSlot,
    LoraAcquire,
    LoraAdapterList,
    LoraSlotsChanged,
    LoraStep,
    LoraStepResult,
)

from .conftest import plugin_env, read_records


class Worker(Actor):
    role = "worker"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.loads: list[tuple[int, str]] = []

    @handles(LoadLoraSlot)
    async def on_load(self, msg: LoadLoraSlot, env: Envelope) -> None:
        self.loads.append((msg.slot, msg.lora_id))


class Scheduler(Actor):
    role = "scheduler"

    @handles(LoraSlotsChanged)
    async def on_changed(self, msg: LoraSlotsChanged, env: Envelope) -> None:
        pass


def test_a_plugin_policy_chosen_by_name_in_a_lora_loader_run_alone(
    plugin_site: Path, tiny_llama: Path, lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "records").mkdir()
    book = {r: f"ipc://{tmp_path}/{r}.sock" for r in ("lora_loader", "worker", "scheduler")}
    cmd = [sys.executable, "-m", "actorlm.cli", "actor", "lora_loader",
           "--bind", book["lora_loader"], "--peer", f"worker={book['worker']}",
           "--peer", f"scheduler={book['scheduler']}", "--model", str(tiny_llama),
           "--max-loras-per-batch", "2", "--max-lora-rank", "16",
           "--lora-eviction-policy", "example_most_used_first",
           "--lora-paths", *(f"{n}={lora_adapters[n]}" for n in ("sql", "chat", "all"))]  # fmt: skip
    env = plugin_env(plugin_site, tmp_path / "records", ACTORLM_PLUGINS="example")
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        loads = asyncio.run(_play(book))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, (tmp_path / "log").read_text()[-3000:]
    ids, loaded = loads
    # sql and chat took the two slots; sql, asked for most, gave its slot up to all
    # (least recently used would have been chat)
    assert loaded == [(0, ids["sql"]), (1, ids["chat"]), (0, ids["all"])]
    records = read_records(tmp_path / "records")
    assert {pid for pid, _ in records["lora_eviction.priority"]} == {proc.pid}
    assert {pid for pid, _ in records["lora_eviction.init"]} == {proc.pid}


async def _play(book: dict[str, str]) -> tuple[dict[str, str], list[tuple[int, str]]]:
    config = EngineConfig()
    transport = ZmqTransport.for_deploy(DeployConfig())
    options = RuntimeOptions(book=dict(book), heartbeat_s=0.2, peer_timeout_s=30)
    worker, scheduler = Worker(config), Scheduler(config)
    runtimes = [ActorRuntime(a, book[a.role], transport, options) for a in (worker, scheduler)]
    tasks = [asyncio.create_task(r.serve()) for r in runtimes]
    try:
        sched = runtimes[1]
        for _ in range(600):  # the loader starts (no torch in it: a second or two)
            try:
                listed = await sched.request("lora_loader", ListLoraAdapters(), timeout=1)
                break
            except ActorError:
                await asyncio.sleep(0.1)
        assert isinstance(listed, LoraAdapterList)
        ids = {a.name: a.lora_id for a in listed.adapters}

        async def step(**kw: object) -> LoraStepResult:
            reply = await sched.request("lora_loader", LoraStep(**kw), timeout=10)  # type: ignore[arg-type]
            assert isinstance(reply, LoraStepResult)
            return reply

        async def until_ready(*names: str) -> None:
            for _ in range(300):
                if {ids[n] for n in names} <= set((await step()).ready):
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{names} never became ready")

        await step(
            acquire=[LoraAcquire("r1", "sql"), LoraAcquire("r2", "chat")], wanted=[ids["sql"]]
        )
        await until_ready("sql")
        await step(wanted=[ids["chat"]])
        await until_ready("sql", "chat")
        await step(acquire=[LoraAcquire(f"s{i}", "sql") for i in range(3)])  # sql: used most
        await step(acquire=[LoraAcquire("r3", "all")], release=["r1", "r2", "s0", "s1", "s2"])
        await step(wanted=[ids["all"]])
        await until_ready("all")
        return ids, worker.loads
    finally:
        for r in runtimes:
            r.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        transport.close()
