"""The fused CPU kernels of gpu/ops.py against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.kernels import ops

pytestmark = pytest.mark.skipif(ops.native_ops() is None, reason="no C compiler here")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (8, 576), (300, 64), (5, 36)])
def test_rms_norm_and_the_fused_residual_add(rows: int, dim: int) -> None:
    g = _gen(rows)
    x, res = torch.randn(rows, dim, generator=g) * 4, torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    assert ops._native(x) is not None  # these inputs take the kernel, not the fallback
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (dim,), w, 1e-6))
    want_sum = x + res
    want = F.rms_norm(want_sum, (dim,), w, 1e-6)
    xx, rr = x.clone(), res.clone()
    out, total = ops.fused_add_rms_norm(xx, rr, w, 1e-6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(total, want_sum)
    assert out.data_ptr() == xx.data_ptr() and total.data_ptr() == rr.data_ptr()  # in place


def test_rms_norm_reads_strided_rows() -> None:
    base = torch.randn(6, 100, generator=_gen(1))
    x = base[:, 10:74]  # row stride 100
    w = torch.randn(64, generator=_gen(2))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))


@pytest.mark.parametrize(("rows", "d"), [(1, 1536), (8, 1536), (64, 20), (3, 13)])
def test_silu_and_mul(rows: int, d: int) -> None:
    x = torch.randn(rows, 2 * d, generator=_gen(d)) * 8
    x[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -1e-30])[: min(4, d)]  # tails and zero
    gate, up = x.split(d, dim=-1)
    assert ops._native(x) is not None  # the kernel, not the fallback
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("heads", "dim"), [(12, 64), (3, 12)])
def test_rotate_halves_in_place_on_a_fused_qkv_view(heads: int, dim: int) -> None:
    T, kv = 7, 2
    g = _gen(heads)
    qkv = torch.randn(T, (heads + kv) * dim, generator=g)
    angles = torch.randn(T, 1, dim // 2, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    view = qkv[:, : heads * dim].view(T, heads, dim)  # v's columns follow: strided rows
    x1, x2 = view.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    untouched = qkv[:, heads * dim :].clone()
    out = ops.rotate_halves(view, cos, sin)
    torch.testing.assert_close(out, want)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, heads * dim :], untouched)


def test_other_dtypes_take_the_torch_path() -> None:
    x = torch.randn(4, 64, generator=_gen(3)).bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    r = torch.randn(4, 64, generator=_gen(4)).bfloat16()
    out, total = ops.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (64,), w, 1e-5))
    g = torch.randn(4, 32, generator=_gen(5)).bfloat16()
    torch.testing.assert_close(ops.silu_and_mul(g), F.silu(g[:, :16]) * g[:, 16:])
