"""The KV pool's tensor: zeros of its declared shape and dtype (on the CPU in anonymous
memory, resident from the start), and what is written reads back."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
from actorlm.gpu.kv_pool import KVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_pool_is_zeros_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    pool = KVPool(3, 7, 16, 2, 64, dtype)
    assert pool.kv.shape == (3, 2, 2, 7, 16, 64) and pool.kv.dtype == dtype
    assert pool.kv.is_contiguous() and not pool.kv.any()
    assert pool.nbytes == 3 * 2 * 2 * 7 * 16 * 64 * pool.kv.element_size()
    k, v = torch.randn(5, 2, 64).to(dtype), torch.randn(5, 2, 64).to(dtype)
    slots = torch.tensor([0, 17, 33, 50, 111])
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k_slots(1)[:, slots].transpose(0, 1), k)
    assert torch.equal(pool.v_slots(1)[:, slots].transpose(0, 1), v)
    assert not pool.kv[0].any() and not pool.kv[2].any()  # other layers untouched
    assert KVPool(1, 0, 16, 1, 8, dtype).kv.numel() == 0  # an empty pool is a tensor too


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_cpu_pool_is_resident_before_any_step() -> None:
    """Its pages are faulted in as it is made, not by the first requests' writes."""

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE

    before = resident()
    pool = KVPool(4, 256, 16, 4, 64, torch.bfloat16)  # 32 MiB
    assert resident() - before >= 0.95 * pool.nbytes
    assert not pool.kv.any()
