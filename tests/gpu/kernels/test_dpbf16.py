"""The bf16 products over block weights (gemv.h's paths through dpbf16.h's dot products,
the avx512bf16 build, and amx.h's tiles, the amx build): against torch's matmul of the
rows rounded to bf16, for each block kind, with a bias, strided rows, rows that are not
whole tiles and weights longer than one expanded chunk; and a bf16 model's fused decode
step of 32 ragged sequences against its own forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.fused_decode import FusedDecoder
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.qgemm import (
    AMX_DQ_MIN_ROWS,
    amx_ready,
    lin_blocks,
    lin_dense,
    linear,
    native_qgemm,
    pack,
)
from actorlm.gpu.runner import ModelRunner

from ..helpers import make_runner
from .levels import LEVELS
from .test_qgemm import _block_model, blocks

pytestmark = pytest.mark.skipif(native_qgemm() is None, reason="needs a C compiler")

# rows from which each build rounds x to bf16 (dpbf16.h, amx.h): fewer keep the fp32 tiles
MIN_ROWS = {"avx512bf16": 5, "amx": 5}
# Q4_1 on the dot products from one row (codes expanded in registers, dpbf16.h)
MIN_ROWS_Q4 = {"avx512bf16": 1, "amx": 5}
_HERE = native.supported_isas(native.cpu_flags(), native._is_x86())
_BF16_LEVELS = [level for level in MIN_ROWS if native.isa(level) in _HERE]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_round_to_bf16_and_meet_the_exact_blocks(level: str, kind: str) -> None:
    """With ``act_bf16`` the avx512bf16 and amx builds (from 5 rows on; the avx512bf16
    build Q4_1 from one row on) round each row to bf16 once and sum its products with
    the blocks' exact values in fp32: torch's fp64 matmul of the rounded rows to fp32's
    tolerance (sums of 1088 products of up to ~8 in size). The other builds and fewer rows keep fp32 rows. 1088 columns are 34
    blocks: three expanded chunks. From AMX_DQ_MIN_ROWS (32) rows the amx build rounds
    each weight to bf16 as well (its tiles then sum over all of K): the fp64 matmul of both rounded."""
    w = blocks((77, 1088), kind, seed=6)  # 77 output rows: a part group
    packed = pack(w)
    assert packed is not None
    b = torch.randn(77)
    lin = lin_blocks(packed, b)
    lin.act_bf16 = 1
    g = torch.Generator().manual_seed(7)
    for rows in (1, 4, 5, 6, 9, 16, 17, 23, 31, 32, 33, 40, 41, 64, 70):
        wide = torch.randn(rows, 1100, generator=g)
        x = wide[:, 5:1093]  # row stride 1100
        got = linear(x, lin, level)
        assert got is not None
        rounds = rows >= (MIN_ROWS_Q4 if kind == "q4_1" else MIN_ROWS).get(level, rows + 1)
        xr = x.bfloat16() if rounds else x
        dq = level == "amx" and rows >= AMX_DQ_MIN_ROWS and amx_ready(level)  # tiles granted
        wr = w.bfloat16() if dq else w
        want = (xr.double() @ wr.double().T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-4)
        if rounds:  # and it did round: fp32 rows land ~1% of the scale away
            assert (got - F.linear(x, w, b)).abs().max() > 1e-3


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", [(77, 576), (250, 96)])  # part groups; one and 3 k tiles
def test_dense_bf16_rows_on_amx_tiles(level: str, shape: tuple[int, int]) -> None:
    """A dense bf16 weight with ``act_bf16``: the amx build rounds rows to bf16 from 5
    rows on and sums their exact products with the weight in fp32 (to 31 rows the
    weight's rows loaded as tiles, a part group through a zero-padded copy, rows beyond a
    tile of 16 in further tiles; from 32 its pairs transposed into B tiles, two groups by
    two tiles of rows, the next pair's transposed ahead); every other build and fewer
    rows keep fp32 rows."""
    n, k = shape
    g = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    lin = lin_dense(w, b)
    assert lin is not None
    lin.act_bf16 = 1
    for rows in (1, 4, 5, 16, 17, 31, 32, 40, 64, 100):
        x = torch.randn(rows, k + 9, generator=g)[:, 4 : 4 + k]  # strided rows
        got = linear(x, lin, level)
        assert got is not None
        rounds = level == "amx" and rows >= MIN_ROWS["amx"]
        xr = x.bfloat16() if rounds else x
        want = (xr.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-4)


def _forced_logits(
    runner: ModelRunner, prompts: list[list[int]], tokens: list[list[int]]
) -> list[torch.Tensor]:
    """Prefill ``prompts``, then one decode step of every sequence per row of ``tokens``
    (the same tokens for every runner: no dependence on either one's argmax)."""
    page = runner.pool.page_size
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]  # 128 tokens each
    runner.run([SeqSpec(p, 0, tables[i]) for i, p in enumerate(prompts)])
    pos = [len(p) for p in prompts]
    out = []
    for step in tokens:
        seqs = [SeqSpec([t], pos[i], tables[i][: pos[i] // page + 1]) for i, t in enumerate(step)]
        out.append(runner.run(seqs))
        pos = [p + 1 for p in pos]
    return out


@pytest.mark.parametrize(("weights", "batch"), [("blocks", 32), ("dense", 32), ("blocks", 64)])
def test_a_bf16_step_of_ragged_sequences_matches_the_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, weights: str, batch: int
) -> None:
    """A bf16 model's fused step at batch 32 against its forward (torch's bf16 GEMMs over
    bf16-rounded weights), and no farther from it than the fp32 tiles of the avx512
    build are, for each build here that rounds the rows: Q4_1 layers and a Q8_0 head
    (avx512bf16's dot products, amx's tiles), or dense bf16 weights (amx's tiles). At
    batch 64 amx's tiles round the block weights to bf16 as the forward's do."""
    levels = _BF16_LEVELS if weights == "blocks" else [x for x in _BF16_LEVELS if x == "amx"]
    if not levels:
        pytest.skip(f"this CPU has no build that rounds the rows of {weights} weights")
    path = tiny_model_factory("llama")
    if weights == "blocks":
        path = _block_model(path, tmp_path / "blocks")
    opts = {"dtype": "bfloat16", "quantization": "gguf", "num_pages": 8 * batch}
    g = torch.Generator().manual_seed(8)
    lens = torch.randint(1, 100, (batch,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tokens = torch.randint(3, 1000, (3, batch), generator=g).tolist()
    want = _forced_logits(make_runner(path, fused_decode_max_batch=0, **opts), prompts, tokens)
    got = {}
    for level in (*levels, "avx512"):
        runner = make_runner(path, fused_decode_max_batch=batch, **opts)
        runner.fused, why = FusedDecoder.build(runner.model, runner.backend, batch, level)
        assert runner.fused is not None, why
        assert runner.fused.step.weights.head.kind == (4 if weights == "blocks" else 1)
        got[level] = _forced_logits(runner, prompts, tokens)
    scale = max(w.abs().max().item() for w in want)
    err = {
        k: max((a - w).abs().max().item() for a, w in zip(v, want, strict=True))
        for k, v in got.items()
    }
    # the tiny dense model's fp32-tile step already lands ~5% of the scale from its bf16
    # forward (the step keeps fp32 between the linears, the forward rounds to bf16)
    bound = 0.03 if weights == "blocks" else 0.06
    for level in levels:
        assert err[level] <= bound * scale, (level, err, scale)
        assert err[level] <= 1.5 * err["avx512"], (level, err, scale)
        assert not torch.equal(got[level][0], got["avx512"][0])  # the rows did round
