"""The bf16 dot products over block weights (gemv.h's path through dpbf16.h, the
avx512bf16 build): against torch's matmul of the rows rounded to bf16, for each block
kind, with a bias, strided rows and weights longer than one expanded chunk; and a bf16
model's fused decode step of 32 ragged sequences against its own forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.fused_decode import FusedDecoder
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.qgemm import lin_blocks, linear, native_qgemm, pack
from actorlm.gpu.runner import ModelRunner

from ..helpers import make_runner
from .levels import LEVELS
from .test_qgemm import _block_model, blocks

pytestmark = pytest.mark.skipif(native_qgemm() is None, reason="needs a C compiler")

DP_MIN_ROWS = 9  # dpbf16.h: fewer rows keep the fp32 tiles
_HAS_DP = native.isa("avx512bf16") in native.supported_isas(native.cpu_flags(), native._is_x86())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_round_to_bf16_and_meet_the_exact_blocks(level: str, kind: str) -> None:
    """With ``act_bf16`` the avx512bf16 build rounds each row to bf16 once (from 9 rows
    on) and sums its products with the blocks' exact values in fp32: torch's fp64
    matmul of the rounded rows to fp32's tolerance (sums of 1088 products of up to ~8
    in size). The other builds and fewer rows keep fp32 rows. 1088 columns are 34
    blocks: three expanded chunks."""
    w = blocks((77, 1088), kind, seed=6)  # 77 output rows: a part group
    packed = pack(w)
    assert packed is not None
    b = torch.randn(77)
    lin = lin_blocks(packed, b)
    lin.act_bf16 = 1
    g = torch.Generator().manual_seed(7)
    for rows in (1, 5, 6, 9, 17, 32, 33):
        wide = torch.randn(rows, 1100, generator=g)
        x = wide[:, 5:1093]  # row stride 1100
        got = linear(x, lin, level)
        assert got is not None
        rounds = level == "avx512bf16" and rows >= DP_MIN_ROWS
        xr = x.bfloat16() if rounds else x
        want = (xr.double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-4)
        if rounds:  # and it did round: fp32 rows land ~1% of the scale away
            assert (got - F.linear(x, w, b)).abs().max() > 1e-3


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


@pytest.mark.skipif(not _HAS_DP, reason="this CPU lacks AVX512-BF16")
def test_a_bf16_step_of_32_ragged_sequences_matches_the_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Q4_1 layers and a Q8_0 head in bf16: the fused step at batch 32 (every linear on
    the dot products) against the model's forward (torch's bf16 GEMMs over bf16-rounded
    weights), and no farther from it than the fp32 tiles of the avx512 build are."""
    path = _block_model(tiny_model_factory("llama"), tmp_path / "blocks")
    opts = {"dtype": "bfloat16", "quantization": "gguf", "num_pages": 256}
    g = torch.Generator().manual_seed(8)
    lens = torch.randint(1, 100, (32,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    tokens = torch.randint(3, 1000, (3, 32), generator=g).tolist()
    want = _forced_logits(make_runner(path, fused_decode_max_batch=0, **opts), prompts, tokens)
    got = {}
    for level in ("avx512bf16", "avx512"):
        runner = make_runner(path, fused_decode_max_batch=32, **opts)
        runner.fused, why = FusedDecoder.build(runner.model, runner.backend, 32, level)
        assert runner.fused is not None, why
        assert runner.fused.step.weights.head.kind == 4  # Q8_0
        got[level] = _forced_logits(runner, prompts, tokens)
    scale = max(w.abs().max().item() for w in want)
    err = {
        k: max((a - w).abs().max().item() for a, w in zip(v, want, strict=True))
        for k, v in got.items()
    }
    assert err["avx512bf16"] <= 0.03 * scale, (err, scale)
    assert err["avx512bf16"] <= 1.5 * err["avx512"], (err, scale)
    assert not torch.equal(got["avx512bf16"][0], got["avx512"][0])  # the rows did round
