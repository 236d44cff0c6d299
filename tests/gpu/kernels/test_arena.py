"""The arena the fused step's AMX tiles live in: tensors carved in order, each on its own
page, none overlapping another, zeros at first, alive after the arena is gone."""

from __future__ import annotations

import gc

import torch
from actorlm.gpu.kernels.arena import Arena


def test_tensors_are_carved_in_order_on_their_own_pages() -> None:
    arena = Arena(chunk=1 << 20)
    sizes = [(1000, torch.int32), (1, torch.uint8), (300_000, torch.int32), (5, torch.bfloat16)]
    ts = [arena.empty(n, dtype) for n, dtype in sizes]  # the third needs a mapping of its own
    for t, (n, dtype) in zip(ts, sizes, strict=True):
        assert t.numel() == n and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0 and not t.any()
    assert ts[1].data_ptr() == ts[0].data_ptr() + 4096  # in order, a page each
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in ts)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    assert [int(t[0]) for t in ts] == [1, 2, 3, 4]  # no tensor wrote over another


def test_a_tensor_outlives_its_arena() -> None:
    arena = Arena(chunk=1 << 16)
    t = arena.empty(1 << 14, torch.int32)
    t.copy_(torch.arange(1 << 14, dtype=torch.int32))
    del arena
    gc.collect()
    torch.empty(1 << 22, dtype=torch.uint8).fill_(7)  # memory reused elsewhere meanwhile
    assert torch.equal(t, torch.arange(1 << 14, dtype=torch.int32))
