"""The native LoRA kernel (kernels/lora.py over cpu_lora.c and lora.h) against the torch
reference (``lora_apply_torch``): batches mixing base rows and several adapters of
different ranks (one of them not adapting the projection), fp32 and bf16, outputs that
are a column slice of a fused projection, weights in the worker pool's rank-major layout."""

from __future__ import annotations

import pytest
import torch
from actorlm.gpu.kernels.lora import describe, lora_apply_native, native_lora
from actorlm.gpu.lora.batch import BASE, LoraBatch
from actorlm.gpu.lora.ops import LoraWeights, lora_apply_torch

pytestmark = pytest.mark.skipif(native_lora() is None, reason="needs a C compiler")

RANKS = [3, 0, 8, 16]  # slot 1 leaves the projection alone
ROWS = [BASE, 2, 2, 0, BASE, 3, 1, 0, 2, 3, 3, BASE, 0]  # not grouped: the kernel needs no order
# grouped by slot as steps are: runs of 1 to 11 rows, which the kernel takes a few at a time
GROUPED = [BASE] * 2 + [0] * 11 + [1] * 3 + [2] * 5 + [3] * 4 + [2] + [3] * 3


def rank_major(w: LoraWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's CPU layout: a [R, slots, k]; b [R, slots, n] with the scaling folded in."""
    a = w.a.permute(1, 0, 2).contiguous()
    b = (w.b.float() * w.scalings[:, None, None]).to(w.b.dtype).permute(2, 0, 1).contiguous()
    return a, b


def weights(k: int, n: int, dtype: torch.dtype) -> LoraWeights:
    adapters = [
        # powers of two: folding the scaling into bf16 b rounds nothing
        (torch.randn(r, k) / k**0.5, torch.randn(n, r), 2.0 ** (i - 1))
        for i, r in enumerate(RANKS)
    ]
    w = LoraWeights.stack(adapters, rank=16)
    return LoraWeights(w.a.to(dtype), w.b.to(dtype), w.ranks, w.scalings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 48), (37, 21), (80, 144)])  # ragged tails; 9 vectors
@pytest.mark.parametrize("rows", [ROWS, GROUPED], ids=["mixed", "grouped"])
def test_native_matches_the_reference(dtype: torch.dtype, k: int, n: int, rows: list[int]) -> None:
    torch.manual_seed(0)
    w = weights(k, n, dtype)
    a, b = rank_major(w)
    x = torch.randn(len(rows), k).to(dtype)
    y0 = torch.randn(len(rows), n).to(dtype)
    want = y0.clone()
    lora_apply_torch(x, want, w, LoraBatch.from_tokens(rows))
    got = y0.clone()
    desc = describe(a, b, w.ranks)
    assert desc is not None
    assert lora_apply_native(x, got, desc, torch.tensor(rows, dtype=torch.int32))
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference rounds the delta too
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    adapted = [s != BASE and RANKS[s] > 0 for s in rows]
    changed = (got != y0).any(1).tolist()
    assert changed == adapted  # base rows and rank-0 slots are never written


def test_output_may_be_a_column_slice_of_a_fused_projection() -> None:
    torch.manual_seed(1)
    w = weights(32, 16, torch.float32)
    a, b = rank_major(w)
    desc = describe(a, b, w.ranks)
    assert desc is not None
    x, fused = torch.randn(len(ROWS), 32), torch.zeros(len(ROWS), 40)
    rows = torch.tensor(ROWS, dtype=torch.int32)
    assert lora_apply_native(x, fused[:, 8:24], desc, rows)
    want = torch.zeros(len(ROWS), 16)
    lora_apply_torch(x, want, w, LoraBatch.from_tokens(ROWS))
    torch.testing.assert_close(fused[:, 8:24], want, rtol=1e-5, atol=1e-5)
    assert fused[:, :8].abs().max() == 0 and fused[:, 24:].abs().max() == 0


def test_what_the_kernel_cannot_take_is_left_to_torch() -> None:
    w = weights(16, 8, torch.float32)
    a, b = rank_major(w)
    desc = describe(a, b, w.ranks)
    assert desc is not None
    rows = torch.zeros(4, dtype=torch.int32)
    x, y = torch.randn(4, 16), torch.zeros(4, 8)
    assert not lora_apply_native(x.double(), y.double(), desc, rows)  # fp64
    assert not lora_apply_native(x, y, desc, rows.long())  # slots must be int32
    assert not lora_apply_native(x[:, :8], y, desc, rows)  # the wrong width
    assert y.abs().max() == 0
    assert describe(a.transpose(0, 1), b, w.ranks) is None  # not the pool's layout
