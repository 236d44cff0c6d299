"""The HiCache file tier: a prefix computed by one server is reused after a restart."""

from __future__ import annotations

import random
from pathlib import Path

from actorlm import Engine


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
