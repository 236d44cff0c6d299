"""Rows quantized to int8 against block weights (dpi8.h, the ``*_a8`` linear methods):
each build against torch's fp64 matmul of the rows quantized the same way (per 32-wide
block, scale max|x| / 127, round to nearest even); the builds without the int8 kernels
ignore the flag. Then the methods on a model: a tiny model of block weights against
transformers, its fused decode step against its own forward, and a clear refusal on
a CPU without the kernels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.fused_decode import FusedDecoder
from actorlm.gpu.kernels import qgemm
from actorlm.gpu.kernels.qgemm import QK, int8_ready, lin_blocks, linear, native_qgemm, pack
from actorlm.gpu.quantization import QUANTIZATION_METHODS, GGUFLinear
from actorlm.gpu.runner import ModelRunner

from ..helpers import (
    PROMPT_A,
    PROMPT_B,
    PROMPT_D,
    Pages,
    greedy,
    hf_greedy,
    hf_last_logits,
    hf_model,
    make_runner,
)
from .levels import INT8_LEVELS
from .test_dpbf16 import _forced_logits
from .test_qgemm import _block_model, blocks

pytestmark = pytest.mark.skipif(native_qgemm() is None, reason="needs a C compiler")
needs_int8 = pytest.mark.skipif(not int8_ready(), reason="this CPU lacks AVX2")


def quantized(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] as the kernel quantizes it, back in fp32: q * d per 32-wide block."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // QK, QK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    assert q.numel() == 0 or q.abs().max() <= 127
    return (q * d).reshape(rows, k)


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_quantize_to_int8_and_meet_the_exact_blocks(level: str, kind: str) -> None:
    """With ``act_int8`` the builds with the int8 kernels quantize every row count's x
    (none at all, strided rows and a block of zeros, scale 0, included) and sum exact
    integer products scaled in fp32: fp64's matmul of the quantized rows to fp32's
    tolerance. The other builds keep fp32 rows."""
    w = blocks((77, 1088), kind, seed=6)  # 77 output rows: a part group; 34 blocks
    packed = pack(w)
    assert packed is not None
    b = torch.randn(77)
    lin = lin_blocks(packed, b)
    lin.act_int8 = 1
    g = torch.Generator().manual_seed(7)
    for rows in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 70):
        wide = torch.randn(rows, 1100, generator=g)
        wide[:1, 5 + 64 : 5 + 96] = 0  # row 0's third block
        x = wide[:, 5:1093]  # row stride 1100
        got = linear(x, lin, level)
        assert got is not None
        xq = quantized(x) if int8_ready(level) else x
        want = (xq.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-4)
        if int8_ready(level) and rows:  # and it did quantize: ~0.5% of the scale from fp32 rows
            assert (got - F.linear(x, w, b)).abs().max() > 1e-2


@pytest.mark.parametrize("level", INT8_LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_bf16_rows_quantize_from_their_own_values(level: str, kind: str) -> None:
    """bf16 rows (strided, each thread quantizing its share of them straight from bf16
    for both threads to read) meet the blocks as their own values quantized: bias
    added, the result in fp32 or rounded to bf16."""
    if not int8_ready(level):
        pytest.skip(f"the {level} build has no int8 kernels")
    w = blocks((77, 1088), kind, seed=3)
    packed = pack(w)
    assert packed is not None
    b = torch.randn(77)
    lin = lin_blocks(packed, b)
    lin.act_int8 = 1
    g = torch.Generator().manual_seed(4)
    for rows in (1, 2, 3, 17, 70):
        x = torch.randn(rows, 1100, generator=g).bfloat16()[:, 3:1091]  # row stride 1100
        want = (quantized(x).double() @ w.double().T + b.double()).float()
        got = linear(x, lin, level, out_dtype=torch.float32)
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-4)
        got16 = linear(x, lin, level)
        assert got16 is not None and got16.dtype == torch.bfloat16
        assert torch.equal(got16, got.bfloat16())
    for out in (torch.float32, torch.bfloat16):  # no rows: nothing staged, nothing to do
        none = linear(x[:0], lin, level, out_dtype=out)
        assert none is not None and none.shape == (0, 77)


@needs_int8
def test_an_int8_layer_keeps_no_dense_copy_and_takes_any_batch_shape() -> None:
    """Every row count and a [batch, tokens, K] input (the transformers fallback's)
    through the blocks, fp32 or bf16; the result of a 3-D input is the 2-D one's."""
    w, b = blocks((40, 96), "q4_1", seed=2), torch.randn(40)
    layer = QUANTIZATION_METHODS.get("gguf_a8")().convert(w, b)
    assert isinstance(layer, GGUFLinear) and layer.dense is None
    x = torch.randn(3, 300, 96)
    flat = layer(x.reshape(-1, 96))
    assert flat.shape == (900, 40)
    torch.testing.assert_close(flat, (quantized(x.reshape(-1, 96)) @ w.T + b), rtol=1e-5, atol=5e-4)
    assert torch.equal(layer(x), flat.reshape(3, 300, 40))
    assert torch.equal(layer(x.transpose(0, 1)), layer(x.transpose(0, 1).contiguous()))
    assert layer.logits(x[0].bfloat16()).dtype == torch.float32


@pytest.mark.skipif(not qgemm.amx_ready(), reason="needs AMX tiles granted")
@pytest.mark.parametrize(("kind", "first"), [("q4_1", 9), ("q8_0", 25)])
def test_amx_takes_int8_rows_that_may_round_to_bf16_from_a_batch_size(
    kind: str, first: int
) -> None:
    """Rows that may be quantized to int8 and rounded to bf16 (a bf16 model's ``*_a8``
    layers) take the int8 products below ``first`` rows (gemv.h's I8_AMX_MIN_ROWS) and
    the AMX tiles from it: bit for bit what each path gives alone."""
    w = blocks((64, 512), kind, seed=9)
    packed = pack(w)
    assert packed is not None
    both, i8, tiles = (lin_blocks(packed) for _ in range(3))
    both.act_int8 = both.act_bf16 = i8.act_int8 = tiles.act_bf16 = 1
    g = torch.Generator().manual_seed(10)
    for rows in (1, first - 1, first, 64):
        x = torch.randn(rows, 512, generator=g).bfloat16()
        got, want = linear(x, both), linear(x, i8 if rows < first else tiles)
        assert got is not None and want is not None
        assert torch.equal(got, want), rows


@pytest.mark.parametrize("amx", [False, True])
def test_a8_layers_keep_a_dense_copy_where_amx_runs_bf16(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    """In bf16 where AMX runs, an ``*_a8`` layer keeps a dense copy and takes batches
    beyond ``AMX_MAX_ROWS`` through it, as ``gguf``'s layers do; elsewhere none."""
    monkeypatch.setattr(qgemm, "amx_ready", lambda level="": amx)
    w, b = blocks((40, 96), "q4_1", seed=2), torch.randn(40)
    method = QUANTIZATION_METHODS.get("gguf_a8")()
    method.check(torch.device("cpu"), torch.bfloat16)
    layer = method.convert(w, b)
    assert isinstance(layer, GGUFLinear) and layer.int8
    assert (layer.dense is not None) == amx
    rows = GGUFLinear.AMX_MAX_ROWS if amx else GGUFLinear.INT8_MAX_ROWS
    assert layer.max_rows(torch.bfloat16) == rows
    x = torch.randn(GGUFLinear.AMX_MAX_ROWS + 1, 96).bfloat16()
    if amx:
        assert torch.equal(layer(x), layer.dense(x))
    else:
        want = quantized(x.float()) @ w.T + b
        torch.testing.assert_close(layer(x).float(), want, rtol=0.02, atol=0.05)


@needs_int8
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_a8_matches_transformers_on_block_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    """Every linear of a tiny model of Q4_1 layers and a Q8_0 head on int8 rows, prompts
    included (where AMX runs bf16, prompts of 9+ tokens run as ``gguf``'s): last logits
    within 3% of the scale of transformers' fp32 ones (measured ~1.5%; ``gguf`` in bf16
    ~0.8%), 32 greedy tokens equal, and not ``gguf``'s logits."""
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    runner = make_runner(path, quantization="gguf_a8", dtype=dtype)
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * runner.info.num_layers + 1
    dense = dtype == "bfloat16" and qgemm.amx_ready()
    assert all(m.int8 and m.lin.act_int8 == 1 and (m.dense is None) != dense for m in layers)
    exact = make_runner(path, quantization="gguf", dtype=dtype)
    ref = hf_model(path)
    pages = Pages()
    for i, prompt in enumerate((PROMPT_A, PROMPT_B, PROMPT_D)):
        want = hf_last_logits(ref, prompt)
        got = runner.run([runner_seq(pages, f"a{i}", prompt)])[0]
        other = exact.run([runner_seq(pages, f"e{i}", prompt)])[0]
        assert (got - want).abs().max() < 0.03 * want.abs().max(), i
        assert dense or (got - other).abs().max() > 1e-3, i
        n = len(prompt) + 1  # and a decode: int8 rows everywhere
        got = runner.run([SeqSpec([7], n - 1, pages.table(f"a{i}", n))])[0]
        other = exact.run([SeqSpec([7], n - 1, pages.table(f"e{i}", n))])[0]
        assert (got - other).abs().max() > 1e-3, i
    assert greedy(runner, "g", PROMPT_B, 32, pages) == hf_greedy(ref, PROMPT_B, 32)


def runner_seq(pages: Pages, name: str, prompt: list[int]) -> SeqSpec:
    return SeqSpec(prompt, 0, pages.table(name, len(prompt)))


@needs_int8
@pytest.mark.parametrize("method", ["q4_1_a8", "q8_0_a8"])
def test_checkpoint_blocks_on_int8_rows(
    tiny_model_factory: Callable[..., Path], method: str
) -> None:
    """An HF checkpoint rounded to blocks as it loads, its rows then quantized: int8
    rows move the logits less than the blocks' rounding of the weights does (the same
    blocks on exact rows, ``q4_1`` / ``q8_0``, against the unrounded model)."""
    path = tiny_model_factory("llama")
    pages = Pages()
    got, blocks_only, full = (
        make_runner(path, quantization=q).run([runner_seq(pages, q, PROMPT_A)])[0]
        for q in (method, method.removesuffix("_a8"), "none")
    )
    assert 1e-4 < (got - blocks_only).abs().max() < (blocks_only - full).abs().max()


@needs_int8
@pytest.mark.parametrize(
    ("dtype", "inter"), [("bfloat16", 128), ("float32", 128), ("float32", 1088)]
)
def test_a8_step_of_ragged_sequences_matches_the_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str, inter: int
) -> None:
    """The fused decode step at batch 32 on int8 rows against the model's forward on
    int8 rows. In bf16 the forward rounds to bf16 between linears and the step keeps
    fp32, so a row's int8 codes may differ by one: within 3% of the scale; in fp32 they
    are the same codes, within 1e-6 of it. At 1088 intermediate columns a thread's gate
    and up run in several chunks over rows quantized once."""
    path = _block_model(tiny_model_factory("llama", intermediate_size=inter), tmp_path / "blocks")
    opts = {"dtype": dtype, "quantization": "gguf_a8", "num_pages": 8 * 32}
    g = torch.Generator().manual_seed(8)
    lens = torch.randint(1, 100, (32,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tokens = torch.randint(3, 1000, (3, 32), generator=g).tolist()
    want = _forced_logits(make_runner(path, fused_decode_max_batch=0, **opts), prompts, tokens)
    runner = make_runner(path, fused_decode_max_batch=32, **opts)
    runner.fused, why = FusedDecoder.build(runner.model, runner.backend, 32)
    assert runner.fused is not None, why
    assert all(x.qkv.act_int8 and x.down.act_int8 for x in runner.fused.step.weights.layers)
    got = _forced_logits(runner, prompts, tokens)
    scale = max(w.abs().max().item() for w in want)
    err = max((a - w).abs().max().item() for a, w in zip(got, want, strict=True))
    assert err <= (0.03 if dtype == "bfloat16" else 1e-6) * scale, (err, scale)


@needs_int8
def test_a8_steps_take_whole_prompts_off_amx(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Where every linear takes int8 rows the forward runs them on the step's own
    kernels at any row count, so the step takes a sequence's 512 new tokens and steps
    of 640 rows, over fp32 and bf16 pools alike; but on AMX, whose tiles take bf16 rows
    from 9 (there this model's 16-wide heads, too narrow for the step's tiles, keep 32
    rows). The same blocks on fp32 rows keep 32 (the forward's GEMMs win past that)."""
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    a8, a8_bf16, fp32 = (
        make_runner(path, quantization=q, dtype=d).fused
        for q, d in (("gguf_a8", "float32"), ("gguf_a8", "bfloat16"), ("gguf", "float32"))
    )
    assert a8 is not None and a8_bf16 is not None and fp32 is not None
    amx = a8.isa == "amx"
    want = (FusedDecoder.MAX_NEW_FP32, FusedDecoder.MAX_BATCH) if amx else (512, 640)
    assert (a8.max_new, a8.max_batch) == want
    assert (a8_bf16.max_new, a8_bf16.max_batch) == want
    assert (fp32.max_new, fp32.max_batch) == (FusedDecoder.MAX_NEW_FP32, FusedDecoder.MAX_BATCH)
    prompt = [SeqSpec(list(range(3, 303)), 0, list(range(19)))]
    assert a8.accepts(prompt) != amx and a8_bf16.accepts(prompt) != amx
    assert not fp32.accepts(prompt)


@needs_int8
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a8_prompt_beside_decodes_in_one_fused_step_matches_the_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, dtype: str
) -> None:
    """A 300-token prompt beside three decodes, on int8 rows, as one fused step where
    the step takes it, against the model's forward: in bf16 within 3% of the scale
    (the forward rounds to bf16 between linears), in fp32 within 1e-5 of it."""
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    opts = {"dtype": dtype, "quantization": "gguf_a8", "num_pages": 64}
    g = torch.Generator().manual_seed(11)
    shorts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 9, 13)]
    prompt = torch.randint(3, 1000, (300,), generator=g).tolist()
    nexts = torch.randint(3, 1000, (3,), generator=g).tolist()

    def logits(runner: ModelRunner) -> torch.Tensor:
        runner.run([SeqSpec(p, 0, [i]) for i, p in enumerate(shorts)])
        step = [
            SeqSpec([t], len(p), [i]) for i, (p, t) in enumerate(zip(shorts, nexts, strict=True))
        ]
        step.append(SeqSpec(prompt, 0, list(range(3, 22))))
        if runner.fused is not None and runner.fused.isa != "amx":
            assert runner.fused.accepts(step)
        return runner.run(step)

    got = logits(make_runner(path, **opts))
    want = logits(make_runner(path, fused_decode_max_batch=0, **opts))
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= (0.03 if dtype == "bfloat16" else 1e-5) * scale, (err, scale)


@pytest.mark.parametrize("method", ["gguf_a8", "q4_1_a8", "q8_0_a8"])
def test_a8_methods_refuse_a_cpu_without_the_int8_kernels(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setattr(qgemm, "int8_ready", lambda level="": False)
    with pytest.raises(
        ValueError, match=f"quantization '{method}' needs the kernels' int8 dot products"
    ):
        QUANTIZATION_METHODS.get(method)().check(torch.device("cpu"), torch.bfloat16)
