"""The Triton element-wise kernels (the CUDA path of gpu/kernels/ops.py) against the
PyTorch ops they replace and HF Llama's bf16 roundings, and against the CPU's C kernels
on the same inputs (on the CPU through Triton's interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.interpreter import enable

DEVICE = enable()

from actorlm.gpu.forward_meta import SeqSpec  # noqa: E402
from actorlm.gpu.kernels import ops  # noqa: E402
from actorlm.gpu.kernels.triton import elementwise as tk  # noqa: E402
from actorlm.gpu.kv_pool import KVPool  # noqa: E402

from ..helpers import Pages, make_runner  # noqa: E402
from .test_ops import _hf_rms_norm  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32: summation order; 16-bit: one ulp where fp32 sums in another order cross a tie
TOL = {
    torch.float32: {"rtol": 2e-6, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 1e-3},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-2},
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 96), (3, 36)])
def test_rms_norm_and_the_fused_residual_add_in_place(
    dtype: torch.dtype, rows: int, dim: int
) -> None:
    x = _randn(rows, dim, seed=rows, scale=4, dtype=dtype)
    res = _randn(rows, dim, seed=dim, dtype=dtype)
    w = _randn(dim, seed=7, dtype=dtype)
    want_sum = (res.float() + x.float()).to(dtype)  # rounded once, as stored
    xx, rr = x.clone(), res.clone()
    got = tk.fused_add_rms_norm(xx, rr, w, 1e-6)
    assert got is not None
    out, total = got
    assert out.data_ptr() == xx.data_ptr() and total.data_ptr() == rr.data_ptr()
    assert torch.equal(total, want_sum)
    torch.testing.assert_close(out, _hf_rms_norm(want_sum, w, 1e-6), **TOL[dtype])
    plain = tk.rms_norm(x, w, 1e-6)
    assert plain is not None
    torch.testing.assert_close(plain, _hf_rms_norm(x, w, 1e-6), **TOL[dtype])
    torch.testing.assert_close(plain.float(), F.rms_norm(x.float(), (dim,), w.float(), 1e-6),
                               **TOL[dtype])  # fmt: skip


def test_rms_norm_reads_strided_rows_and_refuses_what_it_cannot_take() -> None:
    base = _randn(6, 100, seed=1, dtype=torch.float32)
    x = base[:, 10:74]  # row stride 100
    w = _randn(64, seed=2, dtype=torch.float32)
    got = tk.rms_norm(x, w, 1e-5)
    assert got is not None
    torch.testing.assert_close(got, F.rms_norm(x, (64,), w, 1e-5))
    assert tk.rms_norm(base.t(), torch.ones(6), 1e-5) is None  # columns, not rows
    assert tk.rms_norm(base.view(2, 3, 100), torch.ones(100), 1e-5) is None  # not [T, N]
    assert tk.fused_add_rms_norm(base.view(2, 3, 100), base.view(2, 3, 100), w, 1e-5) is None
    assert tk.silu_and_mul(base.t()) is None
    assert tk.fused_add_rms_norm(x, x.bfloat16(), w, 1e-5) is None  # mixed dtypes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "d"), [(1, 1536), (3, 13)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, d: int) -> None:
    wide = _randn(rows, 2 * d + 8, seed=d, scale=8, dtype=dtype)
    x = wide[:, : 2 * d]  # a strided view: the row stride is 2d + 8
    x[0, :4] = torch.tensor([-60.0, 60.0, 0.0, -1e-3])[: min(4, d)].to(dtype)  # tails, zero
    gate, up = x.split(d, dim=-1)
    want = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    got = tk.silu_and_mul(x)
    assert got is not None and got.shape == (rows, d)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got.float(), F.silu(gate.float()) * up.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "rotary"), [(12, 64, 64), (3, 12, 12), (5, 64, 32)])
def test_rotate_halves_in_place_on_a_fused_qkv_view(
    dtype: torch.dtype, heads: int, dim: int, rotary: int
) -> None:
    """q and k heads of a fused qkv buffer (v's columns after them), rotated over their
    first ``rotary`` dims (partial rotary: the rest of each head stays)."""
    T, kv = 7, 2
    qkv = _randn(T, (heads + kv) * dim, seed=heads, dtype=dtype)
    angles = torch.randn(T, 1, rotary // 2, generator=_gen(dim)) * 3
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    view = qkv[:, : heads * dim].view(T, heads, dim)[..., :rotary]
    x1, x2 = view.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # rounds per op
    before = qkv.clone()
    out = tk.rotate_halves(view, cos, sin)
    assert out is not None and out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(out, want, **TOL[dtype])
    rest = qkv.view(T, heads + kv, dim)
    assert torch.equal(rest[:, heads:], before.view(T, heads + kv, dim)[:, heads:])
    assert torch.equal(
        rest[:, :heads, rotary:], before.view(T, heads + kv, dim)[:, :heads, rotary:]
    )
    assert tk.rotate_halves(view, cos.float(), sin.float()) is None or dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "page_size"), [(2, 64, 4), (3, 12, 1), (8, 128, 16)])
def test_write_kv_stores_each_token_where_the_pools_torch_path_does(
    dtype: torch.dtype, heads: int, dim: int, page_size: int
) -> None:
    """k and v as the attention layer hands them (strided views of a fused qkv buffer) to
    scattered slots of one layer's pool, bit for bit as the pool's index_copy_ path; the
    other slots and layers untouched."""
    T, q_heads, pages = 5, 2 * heads, 6
    pool = KVPool(2, pages, page_size, heads, dim, dtype, DEVICE)
    pool.kv.copy_(_randn(*pool.kv.shape, seed=dim, dtype=dtype))
    want = KVPool(2, pages, page_size, heads, dim, dtype, DEVICE)
    want.kv.copy_(pool.kv)
    qkv = _randn(T, (q_heads + 2 * heads) * dim, seed=heads, dtype=dtype)
    k = qkv[:, q_heads * dim : (q_heads + heads) * dim].view(T, heads, dim)
    v = qkv[:, (q_heads + heads) * dim :].view(T, heads, dim)
    slots = torch.randperm(pages * page_size, generator=_gen(T))[:T].to(DEVICE)
    want.k_slots(1).index_copy_(1, slots, k.transpose(0, 1))
    want.v_slots(1).index_copy_(1, slots, v.transpose(0, 1))
    assert tk.write_kv(pool.kv[1], slots, k, v)
    assert torch.equal(pool.kv, want.kv)
    assert tk.write_kv(pool.kv[1], slots[:0], k[:0], v[:0])  # an empty step stores nothing
    assert not tk.write_kv(pool.kv[1], slots.int(), k, v)  # int32 slots: the torch path's
    assert not tk.write_kv(pool.kv[1], slots, k.transpose(1, 2), v)  # nor a head-major k


@pytest.mark.skipif(ops.native_ops() is None, reason="no C compiler here")
def test_the_cuda_kernels_compute_what_the_cpu_kernels_do() -> None:
    """bf16, the same inputs through the Triton kernels (on DEVICE) and cpu_ops.c (on
    the CPU): one function on both devices (within one ulp where a sum's order or an exp
    differs)."""
    dtype, cpu = torch.bfloat16, torch.device("cpu")

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE).clone()

    x = _randn(4, 576, seed=11, scale=3, dtype=dtype).to(cpu)
    r = _randn(4, 576, seed=12, dtype=dtype).to(cpu)
    w = _randn(576, seed=13, dtype=dtype).to(cpu)
    cpu_out, cpu_sum = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    got = tk.fused_add_rms_norm(dev(x), dev(r), dev(w), 1e-5)
    assert got is not None
    assert torch.equal(got[1].cpu(), cpu_sum)
    torch.testing.assert_close(got[0].cpu(), cpu_out, rtol=2**-7, atol=0)
    nan = dev(x)
    nan[0, 3] = float("nan")  # rounding by the bits keeps a NaN a NaN
    normed = tk.rms_norm(nan, dev(w), 1e-5)
    assert normed is not None and normed[0].isnan().all() and not normed[1:].isnan().any()
    gu = _randn(4, 2 * 1536, seed=14, scale=4, dtype=dtype).to(cpu)
    silu = tk.silu_and_mul(dev(gu))
    assert silu is not None
    torch.testing.assert_close(silu.cpu(), ops.silu_and_mul(gu), rtol=2**-7, atol=1e-6)
    qk = _randn(4, 12 * 64, seed=15, dtype=dtype).to(cpu)
    angles = torch.randn(4, 1, 32, generator=_gen(16)) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = tk.rotate_halves(dev(qk).view(4, 12, 64), dev(cos), dev(sin))
    assert rotated is not None
    assert torch.equal(rotated.cpu(), ops.rotate_halves(qk.clone().view(4, 12, 64), cos, sin))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_through_the_triton_kernels_matches_its_other_path(
    dtype: str, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring of ops.py's CUDA branch (arguments, in-place contracts) through a whole
    model's prompt: with the Triton kernels taken for every tensor (here the CPU's, in
    the interpreter; on a GPU, CUDA's) against the same model with them refused (the
    CPU's C kernels, or PyTorch on a GPU)."""
    runner = make_runner(tiny_llama, dtype=dtype, device=str(DEVICE), attention_backend="torch",
                         fused_decode_max_batch=0, disable_cuda_graph=True)  # fmt: skip
    prompt = list(range(300, 341))
    monkeypatch.setattr(ops, "_cuda", lambda x: None)
    want = runner.run([SeqSpec(prompt, 0, Pages().table("a", len(prompt)))])
    calls: list[str] = []

    def triton_always(x: torch.Tensor) -> object:
        calls.append(str(x.dtype))
        return tk

    monkeypatch.setattr(ops, "_cuda", triton_always)
    got = runner.run([SeqSpec(prompt, 0, Pages(first=8).table("a", len(prompt)))])
    assert len(calls) >= 5 * runner.info.num_layers  # two norms, SiLU-and-mul, RoPE, KV write
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert (got - want).abs().max().item() < tol * want.abs().max().item()
