"""LoraLoaderActor: the adapter registry, PEFT reading and the worker's LoRA slots.

It reads and checks adapters off its event loop (``peft``), keeps them in host
memory (``registry``: names, ids, pins, the references requests hold), and decides
which worker slot holds which adapter (``slots``, ``eviction``). Loading a slot is a
task of its own: the weights go to the worker as raw tensor frames while the
running batch goes on, and the scheduler hears ``LoraSlotsChanged`` when the slot
can serve.

Liveness: when the worker goes down its slots are gone (they load again on demand,
pinned ones at once when it is back); when the scheduler goes down every reference
dies with its requests, so pending unloads finish. A restarted loader starts from
``--lora-paths`` alone; the scheduler fails the requests that held references in
its predecessor, and the worker empties its slots, so nothing outlives the
registry that knew it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ...config import DEFAULT_MAX_LORA_RANK
from ...gpu.lora.targets import BaseShapes
from ...gpu.model_info import load_model_info
from ...messages.envelope import Envelope
from ...messages.errors import CallErrorCode, ErrorCode
from ...messages.lora import (
    ListLoraAdapters,
    LoadLoraAdapter,
    LoadLoraSlot,
    LoraAcquired,
    LoraAdapterInfo,
    LoraAdapterList,
    LoraRefused,
    LoraSlotsChanged,
    LoraStep,
    LoraStepResult,
    LoraTargetWeights,
    UnloadLoraAdapter,
)
from ..runtime import Actor, ActorError, handles
from .eviction import make_policy
from .peft import AdapterError, AdapterWeights, read_adapter
from .registry import LoRARef, LoRARegistry, RegistryError, parse_lora_spec
from .slots import SlotLoad, SlotTable

__all__ = ["LoraLoaderActor", "slot_messages"]

log = logging.getLogger(__name__)

PART_BYTES = 64 * 2**20  # tensor bytes per LoadLoraSlot message, well under the size limit


def slot_messages(slot: int, weights: AdapterWeights) -> list[LoadLoraSlot]:
    """``weights`` as the messages that put them in ``slot``, each under PART_BYTES
    (one target's tensors are never split)."""
    parts: list[list[LoraTargetWeights]] = [[]]
    size = 0
    for module in weights.target_modules:
        a, b = weights.targets[module]
        if parts[-1] and size + a.nbytes + b.nbytes > PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(LoraTargetWeights(module=module, a=a, b=b))
        size += a.nbytes + b.nbytes
    n = len(parts)
    return [
        LoadLoraSlot(slot=slot, lora_id=weights.lora_id, targets=p, first=i == 0, last=i == n - 1)
        for i, p in enumerate(parts)
    ]


class LoraLoaderActor(Actor):
    role = "lora_loader"

    async def on_start(self) -> None:
        cfg = self.config.lora
        # config.json or GGUF metadata, never the weights (and no torch in this process)
        self.shapes = BaseShapes.from_info(load_model_info(self.config.model.path))
        self.max_rank = cfg.max_lora_rank or DEFAULT_MAX_LORA_RANK
        self.registry = LoRARegistry(cfg.max_loaded_loras)
        self.slots = SlotTable(cfg.max_loras_per_batch, make_policy(cfg.lora_eviction_policy))
        self.in_use: set[str] = set()  # adapters of running requests, as last told
        self.worker_incarnation = 0  # the worker the ready slots were loaded into
        self._unloaded: dict[str, asyncio.Event] = {}  # lora_id → set when its refs are 0
        self.counts = {"adapter_loads": 0, "adapter_load_failures": 0, "adapter_unloads": 0}
        self.load_ms: list[float] = []
        for spec in cfg.lora_paths:
            name, path, pinned = parse_lora_spec(spec)
            try:
                await self._register(name, path, pinned)
            except (AdapterError, RegistryError) as exc:
                # Read once before start (resolve_config), where a refusal stops it; a
                # file broken since is skipped, so that a restart still comes up.
                log.error("--lora-paths %s: %s", spec, exc)

    def ready_info(self) -> dict[str, Any]:
        return {"max_loras_per_batch": len(self.slots.slots), "max_lora_rank": self.max_rank}

    def stats(self) -> dict[str, Any]:
        refs = self.registry.counts
        return {
            "adapters_loaded": len(self.registry.by_name),
            "adapters_unloading": len(self.registry.by_id) - len(self.registry.by_name),
            "adapter_host_bytes": sum(r.weights.nbytes for r in self.registry.by_id.values()),
            "adapter_refs": sum(refs.values()),
            "slots_total": len(self.slots.slots),
            "slots_used": sum(s is not None for s in self.slots.slots),
            "load_ms_last": self.load_ms[-1] if self.load_ms else 0.0,
            **self.counts,
            **self.slots.stats,
        }

    # -- the registry ---------------------------------------------------------
    def _info(self, ref: LoRARef) -> LoraAdapterInfo:
        slot = self.slots.slot_of(ref.lora_id)
        return LoraAdapterInfo(
            name=ref.name,
            lora_id=ref.lora_id,
            path=ref.path,
            rank=ref.weights.rank,
            target_modules=ref.weights.target_modules,
            pinned=ref.pinned,
            slot=-1 if slot is None else slot,
            refs=self.registry.in_use(ref.lora_id),
            unloading=ref.unloading,
        )

    async def _register(self, name: str, path: str, pinned: bool) -> LoRARef:
        self.registry.check_name(name)  # before reading: a taken name fails at once
        if pinned and self.slots.num_pinned + 1 >= len(self.slots.slots):
            raise RegistryError(
                f"pinning {name!r} would leave no slot for unpinned adapters "
                f"(--max-loras-per-batch {len(self.slots.slots)}, {self.slots.num_pinned} pinned)"
            )
        t0 = time.perf_counter()
        try:
            weights = await self.run_blocking(read_adapter, name, path, self.shapes, self.max_rank)
        except AdapterError:
            self.counts["adapter_load_failures"] += 1
            raise
        ref = LoRARef(name, weights, pinned=pinned)
        self.registry.add(ref)
        self.counts["adapter_loads"] += 1
        self.load_ms.append((time.perf_counter() - t0) * 1e3)
        log.info(
            "adapter %s (rank %d, %s) loaded from %s in %.0f ms",
            name,
            weights.rank,
            ",".join(weights.target_modules),
            weights.path,
            self.load_ms[-1],
        )
        if pinned and "worker" in self.runtime.peers.up:  # else once it is (on_peer_up)
            self._ensure_pinned()
        return ref

    @handles(LoadLoraAdapter)
    async def on_load(self, msg: LoadLoraAdapter, env: Envelope) -> LoraAdapterInfo:
        if not msg.lora_name or not msg.lora_path:
            raise ActorError(
                "send lora_name and lora_path", code=CallErrorCode.INVALID_REQUEST, status=400
            )
        try:
            ref = await self._register(msg.lora_name, msg.lora_path, msg.pinned)
        except (AdapterError, RegistryError) as exc:
            status = getattr(exc, "status", 400)
            raise ActorError(str(exc), code=CallErrorCode.INVALID_REQUEST, status=status) from None
        return self._info(ref)

    @handles(UnloadLoraAdapter)
    async def on_unload(self, msg: UnloadLoraAdapter, env: Envelope) -> LoraAdapterInfo:
        ref = self.registry.unregister(msg.lora_name)
        if ref is None:
            raise ActorError(self._unknown(msg.lora_name), code=CallErrorCode.NOT_FOUND, status=404)
        ref.pinned = False
        self.slots.unpin(ref.lora_id)
        if users := self.registry.in_use(ref.lora_id):
            done = self._unloaded.setdefault(ref.lora_id, asyncio.Event())
            log.info("unloading %s: waiting for %d request(s) using it", ref.name, users)
            await done.wait()
        info = self._info(ref)
        self._forget(ref)
        return info

    def _forget(self, ref: LoRARef) -> None:
        self._unloaded.pop(ref.lora_id, None)
        if ref.lora_id in self.registry.by_id:
            self.registry.remove(ref.lora_id)
            self.slots.drop(ref.lora_id)
            self.counts["adapter_unloads"] += 1
            log.info("adapter %s unloaded", ref.name)

    def _released(self, ref: LoRARef | None) -> None:
        if ref is not None and ref.lora_id in self._unloaded:
            self._unloaded[ref.lora_id].set()

    def _unknown(self, name: str) -> str:
        names = ", ".join(sorted(self.registry.by_name)) or "none"
        return f"no LoRA adapter named {name!r} is loaded (loaded: {names})"

    def _no_model(self, name: str) -> str:
        base = self.config.model.served_model_name or "the base model"
        names = ", ".join(sorted(self.registry.by_name)) or "none"
        return (
            f"The model {name!r} does not exist: this server serves {base!r} and the LoRA "
            f"adapters: {names}"
        )

    @handles(ListLoraAdapters)
    async def on_list(self, msg: ListLoraAdapters, env: Envelope) -> LoraAdapterList:
        return LoraAdapterList(
            adapters=[self._info(r) for r in self.registry.by_id.values()],
            max_loras_per_batch=len(self.slots.slots),
            max_lora_rank=self.max_rank,
        )

    # -- the scheduler's step ---------------------------------------------------
    @handles(LoraStep)
    async def on_step(self, msg: LoraStep, env: Envelope) -> LoraStepResult:
        for rid in msg.release:
            self._released(self.registry.release(rid))
        acquired, refused = [], []
        for a in msg.acquire:
            ref = self.registry.acquire(a.rid, a.name)
            if ref is None:
                refused.append(LoraRefused(a.rid, self._no_model(a.name), ErrorCode.NOT_FOUND))
                continue
            self.slots.touch(ref.lora_id)
            acquired.append(LoraAcquired(a.rid, ref.lora_id))
        self.in_use = set(msg.in_use)
        self._ensure_pinned()
        wanted = [i for i in msg.wanted if i in self.registry.by_id]
        self._start(self.slots.assign(wanted, self.in_use))
        return LoraStepResult(
            acquired=acquired,
            refused=refused,
            ready=self.slots.ready_ids(),
            worker_incarnation=self.worker_incarnation,
        )

    # -- slots ------------------------------------------------------------------
    def _start(self, loads: list[SlotLoad]) -> None:
        for load in loads:
            if load.evicted is not None:
                log.info("slot %d: %s evicted for %s", load.slot, load.evicted, load.lora_id)
            self.spawn(self._load_slot(load), name=f"lora-slot-{load.slot}")

    async def _load_slot(self, load: SlotLoad) -> None:
        """Send the adapter's weights to the worker; the running batch goes on meanwhile."""
        ref = self.registry.by_id.get(load.lora_id)
        if ref is None:
            self.slots.lost(load.slot, load.lora_id)
            return
        try:
            for part in slot_messages(load.slot, ref.weights):
                await self.request("worker", part)
        except ActorError as exc:
            log.warning("loading %s into slot %d failed: %s", ref.name, load.slot, exc)
            self.slots.lost(load.slot, load.lora_id)
            return
        if self.slots.loaded(load.slot, load.lora_id):
            self.worker_incarnation = self.runtime.peer_incarnation("worker")
            await self._notify()

    async def _notify(self) -> None:
        with contextlib.suppress(ActorError):
            await self.send("scheduler", LoraSlotsChanged())

    def _ensure_pinned(self) -> None:
        pinned = [r.lora_id for r in self.registry.by_name.values() if r.pinned]
        if pinned:
            self._start(self.slots.assign(pinned, self.in_use, pin=True))

    async def on_peer_down(self, role: str, reason: str) -> None:
        if role == "worker":
            lost = self.slots.clear()
            self.worker_incarnation = 0
            if lost:
                log.warning("worker down (%s): its %d adapter slot(s) are gone", reason, len(lost))
            await self._notify()
        elif role == "scheduler":
            # Its requests died with it, and so did the references they held.
            self.in_use = set()
            for ref in self.registry.release_all():
                self._released(ref)

    async def on_peer_up(self, role: str) -> None:
        if role == "worker":
            self._ensure_pinned()
            await self._notify()
