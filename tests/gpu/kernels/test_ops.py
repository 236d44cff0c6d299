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
    assert ops._native(x)[0] is not None  # these inputs take the kernel, not the fallback
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
    assert ops._native(x)[0] is not None  # the kernel, not the fallback
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


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's bf16 RMSNorm: fp32 statistics, rounded to bf16 before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def test_bf16_kernels_round_where_hf_llama_rounds() -> None:
    g = _gen(3)
    x, r = (
        (torch.randn(5, 576, generator=g) * 3).bfloat16(),
        torch.randn(5, 576, generator=g).bfloat16(),
    )
    w = torch.randn(576, generator=g).bfloat16()
    assert ops._native(x)[1] == "_bf16"
    out, total = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(total, x + r)
    # one ulp of bf16 where fp32 sums in another order land on the other side of a tie
    torch.testing.assert_close(out, _hf_rms_norm(x + r, w, 1e-5), rtol=2**-7, atol=0)
    torch.testing.assert_close(
        ops.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5), rtol=2**-7, atol=0
    )
    gu = (torch.randn(5, 2 * 1536, generator=g) * 4).bfloat16()
    want = F.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(ops.silu_and_mul(gu), want, rtol=2**-7, atol=1e-6)
    for dim in (64, 80, 24):  # halves of whole vectors, with a tail, all tail
        T, heads = 7, 5
        qk = torch.randn(T, heads * dim, generator=g).bfloat16()
        angles = torch.randn(T, 1, dim // 2, generator=g) * 3
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        view = qk.view(T, heads, dim)
        x1, x2 = view.chunk(2, dim=-1)
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = ops.rotate_halves(view, cos, sin)
        assert out.data_ptr() == qk.data_ptr()
        torch.testing.assert_close(out, want, rtol=2**-7, atol=1e-2)


def test_other_dtypes_take_the_torch_path() -> None:
    x = torch.randn(4, 64, generator=_gen(3)).half()
    w = torch.ones(64, dtype=torch.half)
    r = torch.randn(4, 64, generator=_gen(4)).half()
    assert ops._native(x) == (None, None)
    out, total = ops.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(total, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (64,), w, 1e-5))
    g = torch.randn(4, 32, generator=_gen(5)).half()
    torch.testing.assert_close(ops.silu_and_mul(g), F.silu(g[:, :16]) * g[:, 16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_index_copy(dtype: torch.dtype) -> None:
    """K and V as the model hands them over (views into one qkv row) land where
    KVPool's torch path puts them, bit for bit."""
    layers, heads, pages, ps, D, T = 2, 3, 5, 4, 8, 6
    qkv = torch.randn(T, (4 + 2 * heads) * D, generator=_gen(7)).to(dtype)
    k = qkv[:, 4 * D : (4 + heads) * D].view(T, heads, D)
    v = qkv[:, (4 + heads) * D :].view(T, heads, D)
    slots = torch.tensor([17, 3, 4, 5, 0, 19])
    want = torch.zeros(layers, 2, heads, pages, ps, D, dtype=dtype)
    want[1, 0].view(heads, -1, D).index_copy_(1, slots, k.transpose(0, 1))
    want[1, 1].view(heads, -1, D).index_copy_(1, slots, v.transpose(0, 1))
    got = torch.zeros_like(want)
    assert ops.write_kv(got[1], slots, k, v)
    assert torch.equal(got, want)
    assert not ops.write_kv(got[1], slots, k.float() if dtype != torch.float32 else k.half(), v)
