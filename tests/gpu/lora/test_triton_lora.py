"""The Triton LoRA kernels against plain matmuls, on batches mixing adapters of different
ranks and base-model rows (on the CPU through Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.interpreter import enable

DEVICE = enable()

from actorlm.gpu.lora.batch import BASE, LoraBatch  # noqa: E402
from actorlm.gpu.lora.ops import (  # noqa: E402
    LoraWeights,
    lora_apply,
    lora_apply_torch,
    lora_apply_triton,
)

K, N = 96, 80
RANKS = [(8, 0.5), (16, 2.0), (4, 1.0)]  # (rank, scaling) per adapter slot
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # of the output's scale


def adapters(
    dtype: torch.dtype, pad_to: int = 0
) -> tuple[LoraWeights, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    torch.manual_seed(0)
    raw = [(torch.randn(r, K), torch.randn(N, r), s) for r, s in RANKS]
    cast = [(a.to(DEVICE, dtype), b.to(DEVICE, dtype), s) for a, b, s in raw]
    w = LoraWeights.stack(cast, rank=pad_to)
    w.a[0, RANKS[0][0] :] = 7.0  # padding past a rank holds anything: it must be ignored
    w.b[2, :, RANKS[2][0] :] = -3.0
    return w, raw


def matmuls(x: torch.Tensor, y: torch.Tensor, raw: list, rows: list[int]) -> torch.Tensor:
    """Row by row: y + s * (x A^T) B^T with the unpadded fp32 weights, y where BASE."""
    out = y.float().clone()
    for t, slot in enumerate(rows):
        if slot != BASE:
            a, b, s = raw[slot]
            out[t] += s * (x[t].float().cpu() @ a.T @ b.T).to(out.device)
    return out


MIXED = [0] * 5 + [BASE] * 3 + [1] * 40 + [2] + [BASE] + [0, 0] + [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [MIXED, [2, 0, BASE, 1, 1, 0]], ids=["prefill", "decode"])
def test_kernels_match_matmuls(rows: list[int], dtype: torch.dtype) -> None:
    w, raw = adapters(dtype, pad_to=24)
    batch = LoraBatch.from_tokens(rows)
    x = torch.randn(len(rows), K, device=DEVICE).to(dtype)
    y0 = torch.randn(len(rows), N, device=DEVICE).to(dtype)
    want = matmuls(x, y0, raw, rows)
    got = y0.clone()
    lora_apply_triton(x, got, w, batch)
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() < TOL[dtype] * scale
    base = torch.tensor([r == BASE for r in rows], device=DEVICE)
    assert torch.equal(got[base], y0[base])  # base-model rows untouched, bit for bit
    ref = y0.clone()
    lora_apply_torch(x, ref, w, batch)
    assert (ref.float() - want).abs().max().item() < TOL[dtype] * scale


def test_output_may_be_a_column_slice_of_a_fused_projection() -> None:
    w, raw = adapters(torch.float32)
    rows = [1, 1, BASE, 0]
    x = torch.randn(4, K, device=DEVICE)
    qkv = torch.randn(4, 3 * N, device=DEVICE)
    before = qkv.clone()
    lora_apply_triton(x, qkv[:, N : 2 * N], w, LoraBatch.from_tokens(rows))
    assert (qkv[:, N : 2 * N] - matmuls(x, before[:, N : 2 * N], raw, rows)).abs().max() < 1e-3
    assert torch.equal(qkv[:, :N], before[:, :N]) and torch.equal(
        qkv[:, 2 * N :], before[:, 2 * N :]
    )


def test_a_batch_of_base_rows_only_launches_nothing() -> None:
    w, _ = adapters(torch.float32)
    x, y = torch.randn(3, K, device=DEVICE), torch.randn(3, N, device=DEVICE)
    before = y.clone()
    lora_apply(x, y, w, LoraBatch.from_tokens([BASE] * 3))
    assert torch.equal(y, before)


def test_mismatched_batch_is_refused() -> None:
    w, _ = adapters(torch.float32)
    x, y = torch.randn(3, K, device=DEVICE), torch.randn(3, N, device=DEVICE)
    with pytest.raises(ValueError, match="covers 2 rows"):
        lora_apply_triton(x, y, w, LoraBatch.from_tokens([0, 1]))
    with pytest.raises(ValueError, match="do not stack"):
        LoraWeights(w.a, w.b[:, :, :4], w.ranks, w.scalings)
