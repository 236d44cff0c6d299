"""The cpu backend's C decode kernel against the torch backend's SDPA, and its fallbacks."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from actorlm.gpu.attention.cpu import CpuBackend, torch_prompts_faster
from actorlm.gpu.attention.torch_native import TorchNativeBackend
from actorlm.gpu.forward_meta import ForwardMeta, SeqSpec
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.attention import decode_kernel, prefill_kernel, prefill_tiles
from actorlm.gpu.kernels.step import native_step
from actorlm.gpu.kv_pool import KVPool

from .kernels.levels import LEVELS

# Builds with AVX512-BF16 attend over bf16 pools with bf16 dot products (attend_dp.h):
# q and the probabilities round to bf16 first, as torch's bf16 attention rounds them, which
# moves an output by up to ~2^-9 of the largest value it weighs.
_BF16_DOTS = native.best_isa().name in ("amx", "avx512bf16")


def bf16_pool_atol(v: torch.Tensor, fp32_atol: float) -> float:
    """The absolute tolerance of a decode over a bf16 pool holding values like ``v``."""
    return 2**-8 * v.float().abs().max().item() if _BF16_DOTS else fp32_atol


def decode_batch(
    lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, scale_q: float = 1.0
) -> tuple[KVPool, ForwardMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step over a pool of random K/V whose pages are handed out shuffled."""
    ps = 16
    need = [-(-n // ps) for n in lens]
    pool = KVPool(2, sum(need) + 3, ps, kv_heads, dim, dtype)
    pool.kv.normal_()
    pages = list(range(pool.num_pages))
    random.Random(0).shuffle(pages)
    seqs, at = [], 0
    for n, k in zip(lens, need, strict=True):
        seqs.append(SeqSpec([1], n - 1, pages[at : at + k]))
        at += k
    meta = ForwardMeta.build(seqs, ps)
    B = len(lens)
    # q as the model hands it over: the first H heads of a [B, H + Hkv, D] RoPE output
    q = (torch.randn(B, heads + kv_heads, dim) * scale_q)[:, :heads].to(dtype)
    k, v = torch.randn(B, kv_heads, dim).to(dtype), torch.randn(B, kv_heads, dim).to(dtype)
    return pool, meta, q, k, v


def both(
    pool: KVPool, meta: ForwardMeta, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, CpuBackend]:
    dim = q.shape[-1]
    ref, ours = TorchNativeBackend(pool, heads, dim), CpuBackend(pool, heads, dim)
    ref.init_forward_metadata(meta)
    want = ref.forward(q, k, v, 1, meta)
    ours.init_forward_metadata(meta)
    return want, ours.forward(q, k, v, 1, meta), ours


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # GQA; MHA; values in two passes of 64 floats, or 64 and 16; off the vector path
    [(9, 3, 64), (4, 4, 32), (4, 2, 128), (4, 2, 80), (8, 2, 12)],
)
def test_kernel_matches_sdpa_on_ragged_paged_decodes(heads: int, kv_heads: int, dim: int) -> None:
    torch.manual_seed(0)
    lens = [1, 7, 16, 17, 100, 144, 33]  # one token; page edges; several pages
    pool, meta, q, k, v = decode_batch(lens, heads, kv_heads, dim, torch.float32)
    want, got, ours = both(pool, meta, q, k, v, heads)
    assert ours._kernel is not None, "the C kernel should build on this machine"
    assert got.shape == (len(lens), heads * dim)
    assert (got - want).abs().max().item() < 1e-5


def test_kernel_softmax_is_exact_on_peaked_and_long_contexts() -> None:
    torch.manual_seed(1)
    # large scores (|q.k| in the hundreds): exp underflows for most keys, and a long context
    pool, meta, q, k, v = decode_batch([1000, 3, 513], 6, 2, 64, torch.float32, scale_q=30.0)
    want, got, _ = both(pool, meta, q, k, v, 6)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 12)])
def test_bf16_pools_take_the_bf16_kernel(heads: int, kv_heads: int, dim: int) -> None:
    """The pool's bf16 values (fp32 arithmetic, or bf16 dot products where the build has
    them): within rounding of fp32 SDPA on the same values, then rounded once to bf16
    (relative 2^-8)."""
    torch.manual_seed(2)
    pool, meta, q, k, v = decode_batch([5, 40, 17, 300], heads, kv_heads, dim, torch.bfloat16)
    pool32 = KVPool(2, pool.num_pages, pool.page_size, kv_heads, dim, torch.float32)
    pool32.kv.copy_(pool.kv)
    ref = TorchNativeBackend(pool32, heads, dim)
    ref.init_forward_metadata(meta)
    want = ref.forward(q.float(), k.float(), v.float(), 1, meta)
    ours = CpuBackend(pool, heads, dim)
    assert ours._kernel is not None
    ours.init_forward_metadata(meta)
    got = ours.forward(q, k, v, 1, meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=bf16_pool_atol(pool.kv, 1e-5))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [
        (9, 3, 64),
        (4, 4, 32),
        (16, 1, 128),
        (4, 2, 80),
        (4, 2, 256),
        (4, 4, 64),
        (8, 2, 64),
        (12, 2, 64),
    ],
)
@pytest.mark.parametrize("level", LEVELS)
def test_bf16_decode_kernel_in_each_isa_build(
    heads: int, kv_heads: int, dim: int, level: str
) -> None:
    """Every ISA build's bf16-pool decodes (the AMX one on tiles for head sizes that are
    multiples of 64, the AVX512-BF16 ones on bf16 dot products for the other multiples of
    32, both for up to 16 query heads a KV head: 1-4 of them read off the AMX tile by
    permutes, more gathered; fp32 arithmetic otherwise) against fp32
    SDPA on the same values, over contexts of one key, part pages, whole pages (one and two) and
    several hundred keys."""
    torch.manual_seed(6)
    pool, meta, q, k, v = decode_batch(
        [1, 15, 16, 17, 32, 333], heads, kv_heads, dim, torch.bfloat16
    )
    pool32 = KVPool(2, pool.num_pages, pool.page_size, kv_heads, dim, torch.float32)
    pool32.kv.copy_(pool.kv)
    ref = TorchNativeBackend(pool32, heads, dim)
    ref.init_forward_metadata(meta)
    want = ref.forward(q.float(), k.float(), v.float(), 1, meta)
    lib = native_step(level)
    assert lib is not None
    ours = CpuBackend(pool, heads, dim)
    ours._kernel = ours._kv_kernel = lib.actorlm_paged_decode_kv
    ours.init_forward_metadata(meta)
    assert meta.attn[0].decode.kernel_args  # the kernel, not the torch path
    got = ours.forward(q, k, v, 1, meta)
    dots = level in ("amx", "avx512bf16") and dim % 32 == 0
    atol = 2**-8 * pool.kv.float().abs().max().item() if dots else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=atol)


def test_other_dtypes_take_the_torch_path() -> None:
    torch.manual_seed(2)
    pool, meta, q, k, v = decode_batch([5, 40], 4, 2, 16, torch.float16)
    want, got, ours = both(pool, meta, q, k, v, 4)
    assert ours._kernel is None
    assert torch.equal(got, want)


def test_build_failure_and_opt_out_fall_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    source = Path(native.__file__).with_name("cpu_decode.c")
    build = native.load.__wrapped__  # the uncached builder
    monkeypatch.setenv("ACTORLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ACTORLM_NATIVE", "0")
    assert build(source) is None
    monkeypatch.setenv("ACTORLM_NATIVE", "1")
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING):
        assert build(source) is None
    assert "falling back to PyTorch" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left
    monkeypatch.delenv("CC")
    lib = build(source)  # a fresh cache directory builds it again
    assert lib is not None and len(list((tmp_path / "kernels").glob("*.so"))) == 1
    assert decode_kernel() is not None


def reference_decode(
    pool: KVPool, meta: ForwardMeta, q: torch.Tensor, layer: int, window: int, cap: float = 0.0
) -> torch.Tensor:
    """Each sequence's new query over its last ``window`` keys (0: all), read key by key."""
    B, H, D = q.shape
    groups = H // pool.num_kv_heads
    out = []
    for b in range(B):
        n = meta.start_pos[b] + 1
        pos = torch.arange(max(0, n - window) if window else 0, n)
        pages = torch.tensor(meta.page_tables[b])[pos // pool.page_size]
        slots = pages * pool.page_size + pos % pool.page_size
        keys = pool.k_slots(layer)[:, slots].repeat_interleave(groups, 0)  # [H, L, D]
        vals = pool.v_slots(layer)[:, slots].repeat_interleave(groups, 0)
        scores = torch.einsum("hd,hld->hl", q[b], keys) * D**-0.5
        if cap:
            scores = torch.tanh(scores / cap) * cap
        out.append(torch.einsum("hl,hld->hd", scores.softmax(-1), vals).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("window", [1, 5, 16, 20, 70])
def test_windowed_decodes_attend_to_the_last_window_keys(window: int) -> None:
    torch.manual_seed(3)
    # windows inside one page, on a page edge, across pages, and longer than some contexts
    lens = [1, 7, 16, 17, 100, 144, 33]
    pool, meta, q, k, v = decode_batch(lens, 6, 2, 64, torch.float32)
    meta.layer_windows = (0, window)  # layer 1 windowed
    want, got, ours = both(pool, meta, q, k, v, 6)
    assert ours._kernel is not None
    ref = reference_decode(pool, meta, q, 1, window)
    assert (want - ref).abs().max().item() < 1e-5  # the torch backend's window
    assert (got - ref).abs().max().item() < 1e-5  # the C kernel's


def test_softcapped_fp32_decodes_take_the_capping_kernel() -> None:
    """An fp32 pool's capped decodes run cpu_step.c's kernel (cpu_decode.c does not cap),
    equal to the torch path and to the key-by-key reference."""
    torch.manual_seed(4)
    pool, meta, q, k, v = decode_batch([9, 40, 3], 4, 2, 32, torch.float32, scale_q=20.0)
    meta.layer_windows, meta.logit_softcap = (0, 8), 5.0
    want, got, ours = both(pool, meta, q, k, v, 4)
    assert meta.attn[8].decode.kernel_args  # the kernel, not the torch path
    ref = reference_decode(pool, meta, q, 1, 8, cap=5.0)
    assert (want - ref).abs().max().item() < 1e-5 and (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(("window", "cap"), [(5, 0.0), (20, 0.0), (0, 5.0), (8, 5.0), (70, 50.0)])
def test_bf16_kernel_decodes_windowed_and_softcapped(window: int, cap: float) -> None:
    """Gemma 2's layers (a window, soft-capped scores) on a bf16 pool take the kernel:
    the bf16 values (as above) against the key-by-key reference on the same
    values, the output rounded once to bf16."""
    torch.manual_seed(5)
    lens = [1, 7, 16, 17, 100, 144, 33]
    pool, meta, q, k, v = decode_batch(lens, 6, 2, 64, torch.bfloat16, scale_q=20.0)
    meta.layer_windows, meta.logit_softcap = (0, window), cap
    ours = CpuBackend(pool, 6, 64)
    ours.init_forward_metadata(meta)
    got = ours.forward(q, k, v, 1, meta)
    assert meta.attn[window].decode.kernel_args  # not the torch path
    pool32 = KVPool(2, pool.num_pages, pool.page_size, 2, 64, torch.float32)
    pool32.kv.copy_(pool.kv)
    for b, n in enumerate(lens):  # this step's k and v, as forward stored them
        slot = meta.page_tables[b][(n - 1) // 16] * 16 + (n - 1) % 16
        pool32.k_slots(1)[:, slot], pool32.v_slots(1)[:, slot] = k[b].float(), v[b].float()
    ref = reference_decode(pool32, meta, q.float(), 1, window, cap)
    torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=bf16_pool_atol(pool.kv, 1e-4))


def prefill_batch(
    starts: list[int], news: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[KVPool, ForwardMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (start 0) and chunks extending a cached prefix, pages shuffled, the cached
    tokens' K/V random in the pool."""
    ps = 16
    need = [-(-(s + n) // ps) for s, n in zip(starts, news, strict=True)]
    pool = KVPool(2, sum(need) + 2, ps, kv_heads, dim, dtype)
    pool.kv.normal_()
    pages = list(range(pool.num_pages))
    random.Random(1).shuffle(pages)
    seqs, at = [], 0
    for s, n, k in zip(starts, news, need, strict=True):
        seqs.append(SeqSpec(list(range(1, n + 1)), s, pages[at : at + k]))
        at += k
    meta = ForwardMeta.build(seqs, ps)
    T = sum(news)
    qkv = torch.randn(T, heads + 2 * kv_heads, dim)  # q, k, v as views of one buffer
    q, k, v = qkv.to(dtype).split([heads, kv_heads, kv_heads], dim=1)
    return pool, meta, q, k, v


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    # the last: 8 query heads a KV head, tiles take tasks of 64 tokens
    [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 2, 80), (8, 2, 12), (16, 2, 64)],
)
@pytest.mark.parametrize("level", LEVELS)
def test_bf16_prefill_kernel_matches_sdpa_on_prompts_and_extensions(
    heads: int, kv_heads: int, dim: int, level: str
) -> None:
    """Prompts of 150 and 400 tokens (blocks of 64 queries and keys and their tails; the
    bf16 products' tasks of 64 and 128 tokens), a chunk of 70 over a cached 40, one of 2
    tokens over 300, against fp32 SDPA on the same values (output rounded once to bf16),
    in each ISA build: fp32 arithmetic on the bf16 values (the avx512 build takes two
    query rows a pass, the others one), or in the builds with AVX512-BF16 bf16 products
    for head sizes of 32s (flash.h: on AMX tiles where granted, which round the
    probabilities to bf16, else dot products, which keep 16 bits of them), whose
    results differ from the fp32 path's in their last bits."""
    torch.manual_seed(3)
    pool, meta, q, k, v = prefill_batch(
        [0, 40, 300, 0], [150, 70, 2, 400], heads, kv_heads, dim, torch.bfloat16
    )
    pool32 = KVPool(2, pool.num_pages, pool.page_size, kv_heads, dim, torch.float32)
    ref = TorchNativeBackend(pool32, heads, dim)
    pool32.kv.copy_(pool.kv)
    ref.init_forward_metadata(meta)
    want = ref.forward(q.float(), k.float(), v.float(), 1, meta)
    ours = CpuBackend(pool, heads, dim)
    ours._prefill_kernel = prefill_kernel(level)
    ours._torch_prompts = False  # every prompt to the kernel, on AMX CPUs too
    ours.init_forward_metadata(meta)
    plan = meta.attn[0]
    takes = dim % 16 == 0  # head sizes the kernel takes; others keep torch's path
    assert all(bool(p.kernel_args) == takes for p in plan.prefills)
    got = ours.forward(q, k, v, 1, meta)
    assert got.dtype == torch.bfloat16
    if not takes:
        same = TorchNativeBackend(pool, heads, dim)
        same.init_forward_metadata(meta)
        assert torch.equal(got, same.forward(q, k, v, 1, meta))
        return
    # AMX tiles round the probabilities to bf16 before their product with V (flash_amx.h),
    # as the AVX512-BF16 decodes do (bf16_pool_atol); the dot products carry them in two
    # bf16 parts (flash.h), as near as the fp32 path
    products = level in ("avx512bf16", "amx") and dim % 32 == 0
    tiles = level == "amx" and dim % 64 == 0 and prefill_tiles(level)
    atol = 2**-8 * v.float().abs().max().item() if tiles else 1e-3
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=atol)
    if products:  # and they ran: the fp32 path's result is another
        fp32 = CpuBackend(pool, heads, dim)
        fp32._prefill_kernel = prefill_kernel("avx512")
        fp32._torch_prompts = False
        fp32.init_forward_metadata(meta)
        assert not torch.equal(got, fp32.forward(q, k, v, 1, meta))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 2, 80), (8, 2, 12), (16, 2, 64)],
)
@pytest.mark.parametrize("level", LEVELS)
def test_fp32_prefill_kernel_matches_sdpa_on_prompts_and_extensions(
    heads: int, kv_heads: int, dim: int, level: str
) -> None:
    """An fp32 pool's prompts and chunks over a cached prefix take the kernel's fp32 path
    (flash_f32.h: the rows along the vector lanes in chunks of 4, 3, 2 and 1 vectors,
    blocks of 64 keys and their tails, masks only where a block meets the diagonal),
    and give SDPA's result on the same values within fp32 rounding, in each ISA build:
    prompts of 150 and 400 tokens, 70 over 40 cached, 2 over 300, 48 over 1,104."""
    torch.manual_seed(5)
    pool, meta, q, k, v = prefill_batch(
        [0, 40, 300, 0, 1104], [150, 70, 2, 400, 48], heads, kv_heads, dim, torch.float32
    )
    ref = TorchNativeBackend(pool, heads, dim)
    ref.init_forward_metadata(meta)
    want = ref.forward(q, k, v, 1, meta)
    ours = CpuBackend(pool, heads, dim)
    ours._prefill_kernel = prefill_kernel(level)
    ours.init_forward_metadata(meta)
    takes = dim % 16 == 0
    assert all(bool(p.kernel_args) == takes for p in meta.attn[0].prefills)
    got = ours.forward(q, k, v, 1, meta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert takes == (not torch.equal(got, want))  # the kernel ran where it takes the size


def test_bf16_prompts_take_the_tiles_on_amx() -> None:
    """On AMX CPUs cpu_prefill.c runs head sizes that are multiples of 64 on tiles, and
    torch's flash attention (oneDNN's tiles) the rest, over the kernel's fp32 path; both
    give the kernel's fp32 result within bf16 rounding, for a fresh prompt and a chunk
    over a cached prefix."""
    amx = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert not torch_prompts_faster(amx, 64, tiles=True)
    assert torch_prompts_faster(amx, 80, tiles=True)
    assert torch_prompts_faster(amx, 64, tiles=False)  # the OS refused the tile state
    assert not torch_prompts_faster(frozenset({"avx2", "avx512f", "avx512_bf16"}), 80, False)
    if prefill_kernel() is None:
        pytest.skip("no C compiler: the prefill kernel is not built")
    torch.manual_seed(4)
    pool, meta, q, k, v = prefill_batch([0, 40], [150, 70], 9, 3, 64, torch.bfloat16)
    ours = CpuBackend(pool, 9, 64)
    ours._torch_prompts = True
    ours.init_forward_metadata(meta)
    assert not any(p.kernel_args for p in meta.attn[0].prefills)
    got = ours.forward(q, k, v, 1, meta)
    kernel = CpuBackend(pool, 9, 64)
    kernel._torch_prompts = False
    kernel.init_forward_metadata(meta)
    assert all(p.kernel_args for p in meta.attn[0].prefills)
    atol = 2**-8 * v.float().abs().max().item()  # the tiles' bf16 probabilities
    torch.testing.assert_close(
        got.float(), kernel.forward(q, k, v, 1, meta).float(), rtol=2**-7, atol=atol
    )
