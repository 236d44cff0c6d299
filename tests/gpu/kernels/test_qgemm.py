"""GGUF block formats (``--quantization gguf``): packing finds a GGUF's own blocks
bit for bit, the C kernel against plain fp32 math, and a tiny model whose weights
are block values against transformers on the same weights."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.gguf_file import GGUFFile
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.qgemm import (
    AMX_DQ_MIN_ROWS,
    AMX_TILES_MIN_ROWS,
    QK,
    Lin,
    PackedWeight,
    _pack_lib,
    amx_ready,
    amx_tiles,
    dequantize_blocks,
    gemm,
    lin_blocks,
    lin_dense,
    linear,
    native_qgemm,
    pack,
)
from actorlm.gpu.quantization import Fp16Linear, GGUFLinear, GGUFMethod, fbgemm_available
from torch import nn

from ..helpers import assert_matches_hf, hf_model, make_runner
from .levels import LEVELS

pytestmark = [
    pytest.mark.skipif(not fbgemm_available(), reason="needs fbgemm (x86 PyTorch)"),
    pytest.mark.skipif(native_qgemm() is None, reason="needs a C compiler"),
]


def blocks(shape: tuple[int, int], kind: str, seed: int = 0) -> torch.Tensor:
    """A weight made of block values as llama.cpp writes them: fp16 scales (and
    minimums), codes that reach both ends of their range in every block."""
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    nb = k // QK
    d = (torch.rand(n, nb, 1, generator=g) * 0.05 + 0.01).half().float()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, nb, QK), generator=g)
        q[..., 0], q[..., 1] = 0, 15
        m = (-7.5 * d + torch.randn(n, nb, 1, generator=g) * 0.01).half().float()
        w = q.float() * d + m
    else:
        q = torch.randint(-127, 128, (n, nb, QK), generator=g)
        q[..., 3] = 127
        w = q.float() * d
    return w.reshape(n, k)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_pack_rebuilds_block_weights_exactly(kind: str) -> None:
    w = blocks((70, 96), kind)
    packed = pack(w)
    assert packed is not None and packed.kind == kind and packed.shape == (70, 96)
    assert torch.equal(packed.dequantize(), w)


def test_weights_of_other_formats_do_not_pack() -> None:
    torch.manual_seed(0)
    assert pack(torch.randn(8, 64)) is None  # full precision
    assert pack(torch.randn(8, 64).half().float()) is None  # F16
    assert pack(blocks((8, 64), "q4_1")[:, :40]) is None  # not whole blocks
    inf = blocks((4, 64), "q8_0")
    inf[0, 0] = float("inf")
    assert pack(inf) is None


def _same(a: PackedWeight | None, b: PackedWeight | None) -> bool:
    if a is None or b is None:
        return a is b
    bits = [(x.view(torch.int16) if x.dtype == torch.float16 else x) for x in (a.d, b.d)]
    ms = [x if x is None else x.view(torch.int16) for x in (a.m, b.m)]
    same_m = ms[0] is ms[1] or (ms[0] is not None and ms[1] is not None and torch.equal(*ms))
    return (
        (a.kind, a.shape, a.q.dtype) == (b.kind, b.shape, b.q.dtype)
        and same_m
        and (torch.equal(a.q, b.q) and torch.equal(*bits))
    )


def test_native_pack_is_the_numpy_pack_bit_for_bit() -> None:
    if _pack_lib() is None:  # pack() would fall back to NumPy on both sides
        pytest.skip("needs a C compiler")
    torch.manual_seed(0)
    near = blocks((40, 64), "q4_1")
    near[30, 5] += 1e-3  # one value off its block's grid, far from the first row
    nan = blocks((20, 96), "q8_0")
    nan[19, 95] = float("nan")
    mixed = torch.cat((blocks((1, 64), "q4_1"), blocks((8, 64), "q8_0")))  # row 0 decides
    cases = [blocks(shape, kind, seed) for kind in ("q4_1", "q8_0")
             for seed, shape in enumerate([(70, 96), (16, 32), (1, 64), (33, 128)])]  # fmt: skip
    cases += [
        near,
        nan,
        mixed,
        torch.zeros(20, 64),
        torch.randn(8, 64),
        torch.randn(8, 64).half().float(),
    ]
    for w in cases:
        assert _same(pack(w), pack(w, native_pack=False)), w.shape
    assert all(pack(w) is not None for w in cases[:8])
    assert all(pack(w) is None for w in (near, nan, mixed))


def test_pack_finds_the_default_gguf_blocks(default_gguf: Path) -> None:
    f = GGUFFile(default_gguf)
    name = "blk.3.ffn_down.weight"  # Q4_1: per block fp16 d, fp16 m, 16 bytes of nibbles
    packed = pack(torch.from_numpy(f.dequantize(name).copy()))
    assert packed is not None and packed.kind == "q4_1"
    raw = f.raw(name).reshape(-1, 20)
    d, m = packed.scales()
    assert m is not None
    assert np.array_equal(d.numpy().ravel(), raw[:, 0:2].view(np.float16).ravel())
    assert np.array_equal(m.numpy().ravel(), raw[:, 2:4].view(np.float16).ravel())
    codes, qs = packed.codes().numpy().reshape(-1, QK), raw[:, 4:]
    assert np.array_equal(codes[:, :16], qs & 15) and np.array_equal(codes[:, 16:], qs >> 4)
    embd = pack(torch.from_numpy(f.dequantize("token_embd.weight")[:512].copy()))
    assert embd is not None and embd.kind == "q8_0"


def test_native_dequantize_is_gguf_quants_bit_for_bit(default_gguf: Path) -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    f = GGUFFile(default_gguf)
    for name in ("blk.0.attn_q.weight", "blk.5.ffn_up.weight", "token_embd.weight"):
        qtype = GGMLQuantizationType(f.tensors[name].qtype)
        assert qtype.name in ("Q4_1", "Q8_0")
        ours = dequantize_blocks(f.raw(name), qtype.name.lower())
        assert ours is not None
        ref = np.asarray(dequantize(f.raw(name), qtype), dtype=np.float32).ravel()
        assert np.array_equal(ours.view(np.int32), ref.view(np.int32)), name
        assert np.array_equal(f.dequantize(name).ravel(), ref)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_kernel_is_fp32_math_on_the_block_weights(kind: str) -> None:
    w = blocks((77, 160), kind, seed=1)  # 77 rows: groups of 8 and a part one
    packed = pack(w)
    assert packed is not None
    torch.manual_seed(0)
    for rows in (1, 2, 3, 5, 8, 9, 17):  # tiles of 8 and every tail
        x = torch.randn(rows, 160)
        got = gemm(x, packed)
        assert got is not None
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)
    wide = torch.randn(4, 200)
    strided = wide[:, 20:180]  # row stride 200
    got = gemm(strided, packed)
    assert got is not None
    torch.testing.assert_close(got, strided @ w.T, rtol=1e-5, atol=1e-4)
    assert gemm(strided.double(), packed) is None
    assert gemm(torch.randn(160, 4).t(), packed) is None  # column-major
    with pytest.raises(ValueError, match="columns"):
        gemm(torch.randn(2, 64), packed)


ROWS = (1, 2, 3, 5, 8, 9, 17)  # tiles of 8 and every tail


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_each_isa_build_is_fp32_math_on_the_blocks(level: str, kind: str) -> None:
    """Every level against torch's fp32 matmul on the blocks' values, with a bias, from
    fp32 and from bf16 activations (rounded once to bf16 on the way out)."""
    w = blocks((77, 160), kind, seed=2)  # 77 rows: a group of 16 and a part one
    packed = pack(w)
    assert packed is not None
    b = torch.randn(77)
    lin = lin_blocks(packed, b)
    g = torch.Generator().manual_seed(3)
    for rows in ROWS:
        x = torch.randn(rows, 160, generator=g)
        got = linear(x, lin, level)
        assert got is not None
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        xb = x.bfloat16()
        got16 = linear(xb, lin, level)
        assert got16 is not None and got16.dtype == torch.bfloat16
        want = F.linear(xb.float(), w, b)
        torch.testing.assert_close(got16.float(), want, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_isa_build_reads_dense_rows(level: str, dtype: torch.dtype) -> None:
    """fp32/bf16/fp16 row-major weights (the none and fp16 methods, a bf16 model) against
    torch's fp32 matmul on the same values; K off the vector width takes the tail loop."""
    g = torch.Generator().manual_seed(4)
    for n, k in ((77, 160), (9, 37)):
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
        lin = lin_dense(w, b)
        assert lin is not None
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            got = linear(x, lin, level)
            assert got is not None
            torch.testing.assert_close(got, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("level", LEVELS)
def test_no_rows_in_any_dtype(level: str) -> None:
    """A batch with no rows (an LM head no sequence needs logits from) returns an empty
    result in every dtype pairing, with nothing staged."""
    lin = lin_blocks(pack(blocks((40, 64), "q4_1")))  # type: ignore[arg-type]
    for x_dtype in (torch.float32, torch.bfloat16):
        for out in (torch.float32, torch.bfloat16):
            got = linear(torch.randn(0, 64).to(x_dtype), lin, level, out_dtype=out)
            assert got is not None and got.shape == (0, 40) and got.dtype == out


def test_the_block_builds_agree_bit_for_bit() -> None:
    """avx2 expands 8 rows a vector and avx512 16, in the same order lane by lane."""
    here = native.supported_isas(native.cpu_flags(), native._is_x86())
    if native.isa("avx512") not in here:
        pytest.skip("this CPU lacks AVX-512")
    for kind in ("q4_1", "q8_0"):
        lin = lin_blocks(pack(blocks((100, 576), kind, seed=5)))  # type: ignore[arg-type]
        for rows in ROWS:
            x = torch.randn(rows, 576)
            assert torch.equal(linear(x, lin, "avx2"), linear(x, lin, "avx512"))  # type: ignore[arg-type]


def test_layer_runs_the_kernel_for_small_batches_and_fp16_for_large() -> None:
    w, b = blocks((64, 96), "q4_1"), torch.randn(64)
    layer = GGUFMethod().convert(w, b)
    assert isinstance(layer, GGUFLinear)
    small = torch.randn(GGUFLinear.KERNEL_MAX_ROWS, 96)
    assert torch.equal(layer(small), gemm(small, layer.packed) + b)  # the kernel's result
    torch.testing.assert_close(layer(small), F.linear(small, w, b), rtol=1e-5, atol=1e-4)
    large = torch.randn(GGUFLinear.KERNEL_MAX_ROWS + 1, 96)
    assert torch.equal(layer(large), layer.dense(large))
    assert isinstance(GGUFMethod().convert(torch.randn(64, 96), b), Fp16Linear)


def test_bf16_rows_take_the_blocks_up_to_the_platforms_limit() -> None:
    """bf16 rows take the block kernel's bf16 path (AMX tiles: up to 48 rows on an AMX
    CPU, 8 elsewhere), exact products of the rows and the file's weights summed in fp32
    (from AMX_DQ_MIN_ROWS rows AMX's tiles round the weights to bf16 first, as the dense
    GEMM's copy is); more rows take the dense bf16 GEMM over the weights rounded to bf16."""
    w, b = blocks((64, 96), "q4_1"), torch.randn(64)
    method = GGUFMethod()
    method.check(torch.device("cpu"), torch.bfloat16)
    layer = method.convert(w, b)
    assert isinstance(layer, GGUFLinear)
    # only an amx build runs tiles, and only where the kernel grants their state
    assert amx_ready() <= (native.best_isa().name == "amx")
    assert not amx_ready("avx512bf16")
    limit = layer.max_rows(torch.bfloat16)
    assert limit == (GGUFLinear.AMX_MAX_ROWS if amx_ready() else GGUFLinear.KERNEL_MAX_ROWS)
    assert layer.max_rows(torch.float32) == GGUFLinear.KERNEL_MAX_ROWS
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 96).bfloat16()
        got = layer(x)
        if rows <= limit:
            assert torch.equal(got, linear(x, layer.lin_bf16))  # type: ignore[arg-type]
            wr = w.bfloat16() if amx_ready() and rows >= AMX_DQ_MIN_ROWS else w
            want = (x.double() @ wr.double().T + b.double()).bfloat16()
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
        else:
            assert torch.equal(got, layer.dense(x))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
# 5 groups; a last group of 8; 15 groups, the last of 8 (each thread's next pair
# expanded while its tiles work on the one before)
@pytest.mark.parametrize("shape", [(80, 96), (72, 128), (232, 64)])
@pytest.mark.parametrize("rows", [AMX_DQ_MIN_ROWS, 41, 57, 100])
def test_amx_rows_over_weights_rounded_to_bf16(
    kind: str, shape: tuple[int, int], rows: int
) -> None:
    """From AMX_DQ_MIN_ROWS bf16 rows, AMX's tiles sum whole rows of weights rounded to bf16 (two
    groups of 16 columns and two tiles of 16 rows at a time): every row and column,
    odd group and tile counts and a part group included, is x times those weights in
    fp32 sums of exact products, whole tiles stored straight into the output or through
    the scratch."""
    if not amx_ready():
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    w = blocks(shape, kind, seed=rows)
    method = GGUFMethod()
    method.check(torch.device("cpu"), torch.bfloat16)
    layer = method.convert(w, None)
    assert isinstance(layer, GGUFLinear)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = linear(x, layer.lin_bf16)
    assert got is not None and got.shape == (rows, shape[0])
    want = (x.double() @ w.bfloat16().double().T).bfloat16()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)


def _block_model(src: Path, out: Path) -> Path:
    """``src`` (a tiny HF model) with every linear weight made Q4_1 block values and
    the embedding (the tied LM head) Q8_0, saved to ``out``."""
    model = hf_model(src)
    with torch.no_grad():
        for i, module in enumerate(model.modules()):
            if isinstance(module, nn.Linear) and module is not model.lm_head:
                module.weight.copy_(blocks(tuple(module.weight.shape), "q4_1", seed=i))
        emb = model.get_input_embeddings().weight
        emb.copy_(blocks(tuple(emb.shape), "q8_0", seed=99))
    model.save_pretrained(str(out), safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bf16"])
# a last group of 8; 48 blocks deep (the tiles' slices of k)
@pytest.mark.parametrize("shape", [(72, 128), (80, 1536)])
@pytest.mark.parametrize("rows", [AMX_DQ_MIN_ROWS + 4, AMX_TILES_MIN_ROWS, 300])
def test_tiles_written_once_give_the_expanded_weights_bits(
    kind: str, shape: tuple[int, int], rows: int
) -> None:
    """A weight's AMX tiles written once (``amx_tiles``) give, from AMX_TILES_MIN_ROWS
    bf16 rows, what expanding its blocks (or transposing its bf16 rows) at every call
    gives, to the bit: the same products summed in the same order, however the tiles'
    loops block the rows (a part tile of 12 rows at 300) and k. Fewer rows expand the
    blocks even where the tiles are written (2 bytes a weight read where the codes are
    ~0.56), a dense weight's tiles are read from its first expanded row: the same bits."""
    if not amx_ready():
        pytest.skip("no AMX tiles here (or the OS refused their state)")
    if kind == "bf16":
        plain = lin_dense(torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16())
    else:
        packed = pack(blocks(shape, kind, seed=rows))
        assert packed is not None
        plain = lin_blocks(packed)
    assert plain is not None
    plain.act_bf16 = 1
    tiled = Lin.from_buffer_copy(plain)
    keep = amx_tiles(tiled)
    assert keep is not None and tiled.tiles and not plain.tiles
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    got, want = linear(x, tiled), linear(x, plain)
    assert got is not None and want is not None and torch.equal(got, want)
    assert amx_tiles(lin_dense(torch.randn(shape))) is None  # fp32 rows: no tiles


def test_gguf_method_matches_transformers_on_block_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    # every batch through the kernel, so the whole run computes with the exact weights
    monkeypatch.setattr(GGUFLinear, "KERNEL_MAX_ROWS", 1 << 30)
    runner = make_runner(path, quantization="gguf")
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * runner.info.num_layers + 1  # qkv, o, gate_up, down; the head
    assert runner.model.head.packed.kind == "q8_0"
    ref = hf_model(path)
    assert_matches_hf(runner, ref, [list(range(100, 141)), [5, 17, 923, 4, 4, 88, 1200, 31, 7]])
