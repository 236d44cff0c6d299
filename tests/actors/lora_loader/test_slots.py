"""The loader's pure cores: which slot an adapter takes (eviction order per policy,
pinned and in-use slots kept, queue order, no deadlock), and the registry's references."""

from __future__ import annotations

import pytest
from actorlm.actors.lora_loader.eviction import (
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)
from actorlm.actors.lora_loader.peft import AdapterWeights
from actorlm.actors.lora_loader.registry import (
    LoRARef,
    LoRARegistry,
    RegistryError,
    parse_lora_spec,
)
from actorlm.actors.lora_loader.slots import SlotLoad, SlotTable
from actorlm.extensions.points import LORA_EVICTION_POLICIES
from actorlm.extensions.registry import UnknownNameError


def filled(policy: EvictionPolicy) -> SlotTable:
    """Three slots loaded with a, b, c in that order, then asked for: b, b, a, a, c.
    b was used longest ago, c least often, a went in first."""
    table = SlotTable(3, policy)
    for lora_id in "abc":
        (load,) = table.assign([lora_id], in_use=[])
        assert table.loaded(load.slot, lora_id)
    for lora_id in "bbaac":
        table.touch(lora_id)
    return table


@pytest.mark.parametrize(
    ("policy", "victim"), [(LRUPolicy(), "b"), (LFUPolicy(), "c"), (FIFOPolicy(), "a")]
)
def test_eviction_order_per_policy(policy: EvictionPolicy, victim: str) -> None:
    table = filled(policy)
    (load,) = table.assign(["d"], in_use=[])
    assert load.evicted == victim and table.slot_of("d") == load.slot
    assert not table.is_ready("d") and victim not in table.ready_ids()
    assert table.stats["slot_evictions"] == 1 and table.stats["slot_loads"] == 4
    assert table.stats["slot_hits"] == 5


def test_lfu_breaks_ties_by_recency() -> None:
    table = filled(LFUPolicy())
    table.touch("c")  # c: 3 uses, like a and b; b is the least recent of them
    assert table.assign(["d"], in_use=[])[0].evicted == "b"


def test_pinned_in_use_and_loading_slots_are_never_taken() -> None:
    table = SlotTable(3, LRUPolicy())
    (pin,) = table.assign(["p"], in_use=[], pin=True)
    table.loaded(pin.slot, "p")
    (a,) = table.assign(["a"], in_use=[])
    table.loaded(a.slot, "a")
    (b,) = table.assign(["b"], in_use=[])  # still loading
    assert table.assign(["c"], in_use=["a"]) == []  # p pinned, a running, b loading
    table.loaded(b.slot, "b")
    (c,) = table.assign(["c"], in_use=["a"])
    assert c.evicted == "b" and table.slot_of("p") == pin.slot
    assert table.num_pinned == 1
    table.unpin("p")
    assert table.assign(["d"], in_use=["a", "c"])[0].evicted == "p"


def test_queue_order_protects_adapters_ahead_and_stops_when_nothing_fits() -> None:
    table = SlotTable(2, LRUPolicy())
    for lora_id in "ab":
        table.loaded(table.assign([lora_id], in_use=[])[0].slot, lora_id)
    # x waits behind requests for a; y behind x: x takes b's slot, a is kept, y waits
    loads = table.assign(["a", "x", "y"], in_use=[])
    assert loads == [SlotLoad(table.slot_of("x"), "x", "b")]
    assert table.slot_of("y") is None and table.slot_of("a") is not None


def test_every_running_adapter_different_never_deadlocks() -> None:
    """Two slots, requests for a, b, c, d each running one at a time per slot: the
    waiting adapter gets a slot as soon as a running one finishes, in queue order."""
    table = SlotTable(2, LRUPolicy())
    running: list[str] = []
    queue = list("abcd")
    served = []
    while queue or running:
        for load in table.assign(queue, in_use=running):
            table.loaded(load.slot, load.lora_id)
        ready = [q for q in queue if table.is_ready(q) and q not in running]
        for lora_id in ready[: 2 - len(running)]:
            queue.remove(lora_id)
            running.append(lora_id)
        assert running, "nothing could run: a deadlock"
        served.append(running.pop(0))  # the oldest running request finishes
    assert served == list("abcd")


def test_clear_and_lost_free_slots() -> None:
    table = SlotTable(2, FIFOPolicy())
    (a,) = table.assign(["a"], in_use=[])
    table.lost(a.slot, "a")
    assert table.slot_of("a") is None
    table.loaded(table.assign(["b"], in_use=[])[0].slot, "b")
    assert table.clear() == ["b"] and table.ready_ids() == []
    assert not table.loaded(0, "b")  # a load that finishes after the clear counts for nothing


def test_policies_are_registered_and_checked() -> None:
    assert {"lru", "lfu", "fifo"} <= set(LORA_EVICTION_POLICIES.names())
    assert LORA_EVICTION_POLICIES.flag == "--lora-eviction-policy"
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(UnknownNameError, match="known: fifo, lfu, lru"):
        make_policy("nope")
    LORA_EVICTION_POLICIES.register("bad", object)
    try:
        with pytest.raises(TypeError, match="not an EvictionPolicy"):
            make_policy("bad")
    finally:
        LORA_EVICTION_POLICIES.unregister("bad")


def ref(name: str, lora_id: str = "") -> LoRARef:
    return LoRARef(name, AdapterWeights(name, f"/a/{name}", lora_id or f"id-{name}", 4))


def test_references_make_an_unload_wait_for_the_last_request() -> None:
    reg = LoRARegistry()
    reg.add(ref("a"))
    assert reg.acquire("r1", "a") is not None and reg.acquire("r2", "a") is not None
    assert reg.acquire("r1", "a") is not None  # asked twice, one reference
    assert reg.acquire("r3", "nope") is None
    assert reg.in_use("id-a") == 2
    gone = reg.unregister("a")
    assert gone is not None and gone.unloading and reg.get("a") is None
    assert reg.acquire("r4", "a") is None  # hidden at once from new requests
    assert reg.release("r1") is None  # r2 still uses it
    assert reg.release("r2") is gone  # the last one: the unload can finish
    reg.remove("id-a")
    assert "id-a" not in reg.by_id


def test_a_dead_scheduler_drops_every_reference() -> None:
    reg = LoRARegistry()
    reg.add(ref("a"))
    reg.add(ref("b"))
    reg.acquire("r1", "a")
    reg.acquire("r2", "b")
    reg.unregister("b")
    assert [r.name for r in reg.release_all()] == ["b"]
    assert reg.refs == {} and reg.in_use("id-a") == 0


def test_registry_refusals() -> None:
    reg = LoRARegistry(max_loaded=2)
    reg.add(ref("a"))
    with pytest.raises(RegistryError, match="already loaded") as info:
        reg.add(ref("a", "other"))
    assert info.value.status == 409
    reg.acquire("r", "a")
    reg.unregister("a")
    with pytest.raises(RegistryError, match="still being unloaded"):
        reg.add(ref("a"))  # the same bytes again while the old one drains
    reg.add(ref("b"))
    with pytest.raises(RegistryError, match="--max-loaded-loras 2"):
        reg.add(ref("c"))


def test_lora_path_specs() -> None:
    assert parse_lora_spec("sql=/a/b") == ("sql", "/a/b", False)
    assert parse_lora_spec("sql=/a/b:pinned") == ("sql", "/a/b", True)
    assert parse_lora_spec("/x/chat-v2") == ("chat-v2", "/x/chat-v2", False)
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_spec("=/a")
