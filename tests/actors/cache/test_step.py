"""One CacheStep's decisions, as the cache manager makes them: the order of admissions
(lpm), prompts put off to share a prefix being computed, and the HiCache tier's
stores and loads, on the real cache core and a real storage directory."""

from __future__ import annotations

from pathlib import Path

from actorlm.actors.cache.hicache import HiCacheFile, page_keys
from actorlm.actors.cache.kv_cache import KVCacheManager
from actorlm.actors.cache.step import HiCacheTier, apply_step
from actorlm.messages.cache import AdmitOp, CacheStep, CommitOp, FinishOp

PS = 4
SYSTEM = list(range(100, 140))  # 40 tokens: past the 32 a prompt waits for


def _cached(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    assert apply_step(kv, CacheStep(admits=[AdmitOp(rid, prompt)])).result.admitted
    apply_step(kv, CacheStep(finishes=[FinishOp(rid, prompt)]))


def test_lpm_admits_the_longest_cached_prefix_first_and_ties_keep_queue_order() -> None:
    kv = KVCacheManager(64, PS)
    _cached(kv, "warm", [*SYSTEM, 1])
    admits = [AdmitOp("cold", [7, 7, 7, 7, 7]), AdmitOp("hot", [*SYSTEM, 2]), AdmitOp("c2", [8])]
    fifo = apply_step(KVCacheManager(64, PS), CacheStep(admits=admits)).result
    assert [a.rid for a in fifo.admitted] == ["cold", "hot", "c2"]
    lpm = apply_step(kv, CacheStep(admits=admits, longest_prefix_first=True)).result
    assert [a.rid for a in lpm.admitted] == ["hot", "cold", "c2"]
    assert lpm.admitted[0].cached_len == len(SYSTEM)
    kv.check_invariants()


def test_a_prompt_sharing_a_prefix_being_computed_waits_for_it() -> None:
    kv = KVCacheManager(64, PS)
    first, second = [*SYSTEM, 1, 2], [*SYSTEM, 3]
    out = apply_step(kv, CacheStep(admits=[AdmitOp("a", first), AdmitOp("b", second)]))
    assert [a.rid for a in out.result.admitted] == ["a"] and out.prefix_waits == 1
    # a's prefill is in the tree: b's admission shares it instead of computing it again
    out = apply_step(kv, CacheStep(commits=[CommitOp("a", first)], admits=[AdmitOp("b", second)]))
    assert out.prefix_waits == 0 and "a" in out.result.committed
    (b,) = out.result.admitted
    assert b.cached_len == len(SYSTEM) and b.page_ids[:10] == out.result.committed["a"][:10]
    kv.check_invariants()


def test_a_refused_admission_stops_the_rest_but_a_waiting_one_does_not() -> None:
    kv = KVCacheManager(12, PS)
    out = apply_step(
        kv,
        CacheStep(
            admits=[
                AdmitOp("a", [*SYSTEM, 1]),  # 11 pages
                AdmitOp("wait", [*SYSTEM, 2]),  # put off: passed over
                AdmitOp("fits", [5]),  # the last free page
                AdmitOp("big", [6] * 9),  # no room: stops here
                AdmitOp("after", [9]),
            ]
        ),
    )
    assert [a.rid for a in out.result.admitted] == ["a", "fits"] and out.prefix_waits == 1


def test_the_hicache_tier_stores_each_page_once_and_a_new_server_loads_them(
    tmp_path: Path,
) -> None:
    storage = HiCacheFile(tmp_path)
    tier = HiCacheTier(storage, "m")
    kv = KVCacheManager(64, PS)
    prompt = [*SYSTEM, 1, 2]  # 10 full pages and a partial one
    (a,) = apply_step(kv, CacheStep(admits=[AdmitOp("a", prompt)]), tier).result.admitted
    out = apply_step(kv, CacheStep(commits=[CommitOp("a", prompt)]), tier).result
    keys = page_keys("m", prompt, PS)
    assert [(io.key, io.page_id) for io in out.store_pages] == list(
        zip(keys, a.page_ids[:10], strict=True)
    )
    out = apply_step(kv, CacheStep(finishes=[FinishOp("a", prompt)]), tier).result
    assert out.store_pages == []  # already stored: not named again
    for key in keys:  # what the worker does with store_pages
        storage.set(key, b"kv")

    # Another server on the same storage: its tree is empty, storage holds the prefix.
    fresh, other = KVCacheManager(64, PS), HiCacheTier(HiCacheFile(tmp_path), "m")
    step = apply_step(fresh, CacheStep(admits=[AdmitOp("b", [*prompt, 3])]), other)
    (b,) = step.result.admitted
    assert b.cached_len == 10 * PS and step.storage_hit_pages == 10
    assert [(io.key, io.page_id) for io in step.result.load_pages] == list(
        zip(keys, b.page_ids[:10], strict=True)
    )
    # another adapter's KV is not this one's: no hit under its namespace
    lora = apply_step(fresh, CacheStep(admits=[AdmitOp("c", prompt, lora_id="A")]), other)
    assert lora.storage_hit_pages == 0 and lora.result.admitted[0].cached_len == 0
    # storage lost a key: the tier asks again, and the prefix stops at the gap
    storage.delete(keys[5])
    other.forget([keys[5]])
    third = apply_step(KVCacheManager(64, PS), CacheStep(admits=[AdmitOp("d", prompt)]), other)
    assert third.storage_hit_pages == 5
