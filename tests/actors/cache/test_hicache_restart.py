"""The HiCache file tier: a prefix computed by one server is reused after a restart."""

from __future__ import annotations

import random
from pathlib import Path

from actorlm import Engine
from actorlm.actors.client import RequestFailed


def test_restarted_server_serves_a_stored_prefix_without_recomputing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(100, 49000) for _ in range(200)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
    options = dict(
        placement="inproc",
        kv_cache_gb=0.05,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "kv"),
    )
    with Engine(str(tiny_llama), **options) as first:
        cold = first.generate(prompt, params)
        assert first.stats()["scheduler"]["prefill_tokens"] == len(prompt)
    assert len(list((tmp_path / "kv").rglob("*"))) >= len(prompt) // 16

    with Engine(str(tiny_llama), **options) as second:
        warm = second.generate(prompt, params)
        stats = second.stats()
    assert warm.token_ids == cold.token_ids
    assert stats["cache_manager"]["storage_hit_pages"] == (len(prompt) - 1) // 16
    assert stats["scheduler"]["prefill_tokens"] <= len(prompt) - 192
    assert warm.usage.cached_tokens >= 192


def test_damaged_entries_are_misses_never_kv(tiny_llama: Path, tmp_path: Path) -> None:
    """A truncated entry is a plain miss (the prefix is computed); a damaged one is found
    by its checksum when the worker reads it: that request fails retryably, the entry is
    dropped, and the retry is computed. The tokens are a cold server's either way."""
    rng = random.Random(12)
    prompt = [rng.randrange(100, 49000) for _ in range(100)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
    store = tmp_path / "kv"
    options = dict(
        placement="inproc",
        kv_cache_gb=0.05,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store),
    )
    with Engine(str(tiny_llama), **options) as first:
        cold = first.generate(prompt, params)
    files = sorted(p for p in store.rglob("*") if p.is_file())
    assert len(files) >= 4
    keys = {p.name: p for p in files}
    # Which file holds which page is not known here: damage every entry one way or another.
    for i, path in enumerate(keys.values()):
        data = path.read_bytes()
        if i % 2:
            path.write_bytes(data[: len(data) // 2])  # truncated (a power loss, a full disk)
        else:
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one flipped byte
    with Engine(str(tiny_llama), **options) as second:
        outs = []
        for _ in range(3):
            try:
                outs.append(second.generate(prompt, params))
                break
            except RequestFailed as exc:
                assert exc.status == 503 and "could not be read back" in str(exc)
        stats = second.stats()
    assert outs and outs[-1].token_ids == cold.token_ids
    assert stats["worker"]["storage_corrupt"] + stats["cache_manager"]["storage_corrupt"] >= 1
