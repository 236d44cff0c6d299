from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from actorlm.actors.cache.hicache import HiCacheFile, HiCacheStorage, page_keys
from actorlm.extensions.points import HICACHE_STORAGE


def test_page_keys_chain_the_whole_prefix() -> None:
    keys = page_keys("m", [1, 2, 3, 4, 5], 2)
    assert len(keys) == 2  # the trailing partial page has no key
    assert page_keys("m", [1, 2, 3, 4], 2) == keys
    # Same second page after a different first page: a different key.
    assert page_keys("m", [9, 9, 3, 4], 2)[1] != keys[1]
    assert page_keys("other-model", [1, 2, 3, 4], 2) != keys
    assert page_keys("m", [1, 2, 3, 4], 4)[0] not in keys
    assert page_keys("m", [], 2) == [] and page_keys("m", [1], 2) == []
    assert len(set(keys)) == 2


def test_page_keys_are_stable_across_processes() -> None:
    code = (
        "from actorlm.actors.hicache import page_keys;"
        "print(','.join(page_keys('org/model', list(range(40)), 16)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # a different str hash must not matter
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().split(",") == page_keys("org/model", list(range(40)), 16)


def test_write_read_exists_delete(tmp_path: Path) -> None:
    store = HiCacheFile(tmp_path)
    key = page_keys("m", [1, 2], 2)[0]
    assert not store.exists(key) and store.get(key) is None
    assert store.set(key, b"kv-bytes")
    assert store.exists(key) and store.get(key) == b"kv-bytes"
    store.set(key, b"newer")
    assert store.get(key) == b"newer"
    store.delete(key)
    assert not store.exists(key)
    store.delete(key)  # deleting a missing key is fine


def test_batch_operations_stop_at_the_first_gap(tmp_path: Path) -> None:
    store = HiCacheFile(tmp_path)
    keys = page_keys("m", list(range(8)), 2)
    assert store.batch_set(keys[:2], [b"a", b"b"])
    store.set(keys[3], b"d")
    assert store.batch_exists(keys) == 2  # keys[2] missing: keys[3] is unusable
    assert store.batch_get(keys) == [b"a", b"b", None, b"d"]
    with pytest.raises(ValueError):
        store.batch_set(keys, [b"x"])
    store.clear()
    assert store.batch_exists(keys) == 0


def test_a_new_instance_on_the_same_directory_reuses_pages(tmp_path: Path) -> None:
    tokens = list(range(32))
    first = HiCacheFile(tmp_path / "kv")
    for i, key in enumerate(page_keys("m", tokens, 8)):
        first.set(key, bytes([i]) * 16)
    del first
    # A "restarted server": fresh object, keys recomputed from the same prompt.
    second = HiCacheFile(tmp_path / "kv")
    keys = page_keys("m", tokens + [99], 8)
    assert second.batch_exists(keys) == 4
    assert second.get(keys[2]) == bytes([2]) * 16


def test_failed_write_leaves_no_partial_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = HiCacheFile(tmp_path)
    key = page_keys("m", [1, 2], 2)[0]
    store.set(key, b"old")

    def crash(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.set(key, b"new-but-never-visible")
    monkeypatch.undo()
    assert store.get(key) == b"old"
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != key]
    assert leftovers == []  # the temp file was removed


def test_writes_go_through_a_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = HiCacheFile(tmp_path, fsync=True)
    key = page_keys("m", [1, 2], 2)[0]
    seen: list[tuple[bytes, bool]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        # At rename time the final name must not exist yet and the temp file is complete.
        seen.append((Path(src).read_bytes(), Path(dst).exists()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store.set(key, b"blob")
    assert [(data.endswith(b"blob"), exists) for data, exists in seen] == [(True, False)]
    assert store.exists(key) and store.get(key) == b"blob"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "foreign"])
def test_a_damaged_entry_is_dropped_and_counted(tmp_path: Path, damage: str) -> None:
    store = HiCacheFile(tmp_path)
    key = page_keys("m", [1, 2], 2)[0]
    store.set(key, b"x" * 1000)
    path = next(p for p in tmp_path.rglob("*") if p.is_file())
    data = path.read_bytes()
    path.write_bytes(
        {
            "truncate": data[:500],
            "flip": data[:-1] + b"y",
            "empty": b"",
            "foreign": b"not ours at all, but long enough for a header",
        }[damage]
    )
    found = store.exists(key) and store.get(key) is not None
    assert not found and store.corrupt == 1
    assert not path.exists()  # dropped, so the next writer replaces it
    assert store.get(key) is None and store.corrupt == 1  # a plain miss from now on


def test_keys_cannot_escape_the_directory(tmp_path: Path) -> None:
    store = HiCacheFile(tmp_path / "kv")
    for bad in ["../x", "a/b", "", ".hidden", "x.tmp"]:
        with pytest.raises(ValueError):
            store.set(bad, b"x")


def test_registered_as_file() -> None:
    cls = HICACHE_STORAGE.get("file")
    assert cls is HiCacheFile and issubclass(cls, HiCacheStorage)
    assert HICACHE_STORAGE.entry("file").source == "builtin"
