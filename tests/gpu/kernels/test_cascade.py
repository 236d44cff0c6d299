"""Cascade attention in the fused decode step and in the cpu backend's decodes: rows
whose contexts begin in the same pages (a system prompt the prefix cache shares) read
them once a chunk of rows and merge that part of their softmax with the part over their
own tokens. The logits must be those of attending row by row, for each ISA build and
both pool dtypes."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from actorlm.gpu.attention.cpu import CpuBackend
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.fused_decode import FusedDecoder
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.step import Cascade, native_step
from actorlm.gpu.runner import ModelRunner

from ..helpers import make_runner
from .levels import LEVELS

pytestmark = pytest.mark.skipif(native_step() is None, reason="needs a C compiler")

PS = 16


def test_rows_holding_the_same_pages_are_grouped() -> None:
    # rows 0, 2, 3, 5, 6: pages 100-143 (704 tokens), then their own; row 1 shares
    # nothing; row 4 only the first two pages (it holds another page at the probe index)
    shared = list(range(100, 144))
    n = len(shared) * PS
    tables = np.array(
        [
            [*shared, 200, 201],
            list(range(300, 346)),
            [*shared, 210, 211],
            [*shared, 220, 0],
            [100, 101, *range(400, 444)],
            [*shared, 230, 231],
            [*shared, 240, 241],
        ],
        np.int64,
    )
    lens = np.array([n + 18, n + 28, n + 8, n + 1, n + 28, n + 13, n + 32], np.int64)
    c = Cascade.find(tables, lens, PS, group_size=5)
    assert c is not None
    assert c.row_shared.tolist() == [n, 0, n, n, 0, n, n]
    assert c.chunk_ptr.tolist() == [0, 5] and sorted(c.chunk_rows.tolist()) == [0, 2, 3, 5, 6]
    three = Cascade.find(tables, lens, PS, group_size=3)  # near-equal chunks of at most 3
    assert three is not None and three.chunk_ptr.tolist() == [0, 3, 5]
    # a row whose new token is in the last shared page shares the pages before it only
    short = lens.copy()
    short[3] = n - 10
    c = Cascade.find(tables, short, PS, group_size=5)
    m = n - PS
    assert c is not None and c.row_shared.tolist() == [m, 0, m, m, 0, m, m]
    # four rows are too few, however much they share
    assert Cascade.find(tables[[0, 2, 3, 5]], lens[[0, 2, 3, 5]], PS, group_size=5) is None
    # but groups count together: two of three rows each (their own shared pages)
    other = [*range(500, 544), 250, 251]
    two = np.array([tables[0], tables[2], tables[3], other, other, other], np.int64)
    two[4, -2:], two[5, -2:] = [260, 261], [270, 271]
    c = Cascade.find(two, lens[[0, 2, 3, 0, 2, 3]], PS, group_size=5)
    assert c is not None and c.row_shared.tolist() == [n] * 6
    assert c.chunk_ptr.tolist() == [0, 3, 6]


def test_nothing_is_grouped_where_too_little_is_shared() -> None:
    tables = np.array([[1, 2, 3, 4, 5 + i, 6 + i] for i in range(0, 12, 2)], np.int64)
    lens = np.full(6, 90, np.int64)  # 64 tokens shared by six rows: 320 saved
    assert Cascade.find(tables, lens, PS, group_size=8) is None
    assert Cascade.find(tables[:1], lens[:1], PS, group_size=8) is None
    assert Cascade.find(tables, lens, PS, group_size=1) is None


def run_shared_prefix(
    runner: ModelRunner, rows: int, shared: int, tails: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Cascade | None]:
    """``rows`` sequences over one ``shared``-token prompt (computed once, its pages in
    every table) and tails of their own, then one decode step of all of them three times
    (each writes the same KV): with the cascade, attending row by row, and through the
    model's own forward."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 30000, (shared,), generator=g).tolist()
    head = list(range(shared // PS))
    runner.run([SeqSpec(prompt, 0, head)])
    free = iter(range(len(head), runner.pool.num_pages))
    tables, steps = [], []
    for i in range(rows):
        tail = torch.randint(10, 30000, (tails[i % len(tails)],), generator=g).tolist()
        end = shared + len(tail) + 1
        table = head + [next(free) for _ in range(-(-end // PS) - len(head))]
        first = runner.run([SeqSpec(tail, shared, table, prompt_len=end - 1)])
        tables.append(table)
        steps.append(SeqSpec([int(first[0].argmax())], end - 1, table))
    fused = runner.fused
    assert fused is None or fused.accepts(steps)
    width = max(len(t) for t in tables)
    pages = np.array([t + [0] * (width - len(t)) for t in tables], np.int64)
    lens = np.array([s.start_pos + 1 for s in steps], np.int64)
    info = runner.info
    found = Cascade.find(pages, lens, PS, Cascade.sequences(info.num_heads, info.num_kv_heads))
    backend = runner.backend
    assert isinstance(backend, CpuBackend)
    out = []
    for on in (True, False):
        backend.cascade = on
        if fused is not None:
            fused.cascade = on
        out.append(runner.run(steps))
    runner.fused = None  # the model's forward, its backend attending row by row
    ref = runner.run(steps)
    runner.fused = fused
    return out[0], out[1], ref, found


def assert_cascaded(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel attended in a cascade: its sums run in another order than row by row,
    so some bits of the logits differ (a kernel that refused the chunks, or a step never
    given them, gives the row-by-row bits)."""
    assert not torch.equal(got, want)


@pytest.fixture(scope="module")
def d64(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default model's head shape (D 64, 3 query heads a KV head). Weights of a
    narrower spread than the other tests' keep bf16's roundings from growing through the
    layers: they are what is compared."""
    return tiny_model_factory(
        "llama",
        hidden_size=192,
        num_attention_heads=3,
        num_key_value_heads=1,
        initializer_range=0.05,
    )


# tails from one token to several pages, one ending a page exactly
TAILS = [1, 7, 15, 16, 40, 3, 29]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_gives_the_row_by_row_logits(d64: Path, level: str, dtype: str) -> None:
    """The default model's head shape (D 64, 3 query heads a KV head: chunks of 5 rows,
    the tiles' and dot products' paths over bf16 pages) with 12 rows in three chunks."""
    runner = make_runner(d64, dtype=dtype, num_pages=400)
    runner.fused, why = FusedDecoder.build(runner.model, runner.backend, 32, level)
    assert runner.fused is not None, why
    got, want, ref, found = run_shared_prefix(runner, 12, 256, TAILS)
    assert found is not None and found.chunk_ptr.tolist() == [0, 4, 8, 12]
    assert found.row_shared.tolist() == [256] * 12
    assert_cascaded(got, want)
    if dtype == "float32":  # summation orders alone
        assert (got - want).abs().max().item() < 1e-4
        assert (got - ref).abs().max().item() < 1e-4
    else:  # q and each part's probabilities rounded to bf16 apart: as far from the
        # model's forward as attending row by row is (both ~0.025 on AMX, 2026-12-05)
        assert (got - ref).abs().max().item() < 0.05
        assert (want - ref).abs().max().item() < 0.05


def test_cascade_over_small_heads(tiny_llama: Path) -> None:
    """The tiny model's 16-wide heads take the generic loops; 2 query heads a KV head."""
    runner = make_runner(tiny_llama, num_pages=400)
    got, want, ref, found = run_shared_prefix(runner, 9, 320, TAILS)
    assert found is not None and found.row_shared.tolist() == [320] * 9
    assert_cascaded(got, want)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - ref).abs().max().item() < 1e-4


def test_the_backends_decodes_attend_in_a_cascade(d64: Path) -> None:
    """Decodes the fused step does not take (here: turned off) go through the cpu
    backend's kernel over the bf16 pool, with the same cascade. The kernel's fp32
    outputs are compared, each call given chunks run again without them: builds that
    keep q in fp32 (no AVX512-BF16) differ from attending row by row only in the last
    bits, which the model's bf16 rounding of the outputs may hide from the logits; the
    builds with bf16 products (AVX512-BF16, AMX) round q and the probabilities to bf16,
    each part's against its own maximum, so there the two orders agree to bf16's
    precision of the outputs' scale (2.9e-4 at a scale of 0.18-0.62 on a Zen 4; held
    to 2^-7 of it)."""
    runner = make_runner(d64, dtype="bfloat16", num_pages=400, fused_decode_max_batch=0)
    backend = runner.backend
    assert isinstance(backend, CpuBackend) and backend._kv_kernel is not None
    kernel, diffs, scales = backend._kv_kernel, [], []

    def both_ways(*args: Any) -> int:
        rc = kernel(*args)
        if rc == 0 and args[_N_CHUNKS]:
            B, Hkv, G, D = args[_OUT + 1 : _OUT + 5]
            out = _floats(args[_OUT], B * Hkv * G * D).clone()
            plain = torch.empty_like(out)
            again = list(args)
            again[_OUT], again[_N_CHUNKS] = plain.data_ptr(), 0
            assert kernel(*again) == 0
            diffs.append((out - plain).abs().max().item())
            scales.append(plain.abs().max().item())
        return rc

    backend._kv_kernel = both_ways
    got, want, _, found = run_shared_prefix(runner, 12, 256, TAILS)
    assert runner.fused is None and found is not None
    assert len(diffs) == runner.info.num_layers  # every layer of the cascaded step
    assert max(diffs) > 0  # another order of the same sums
    if native.best_isa().name in ("avx512bf16", "amx"):
        assert all(d < 2**-7 * s for d, s in zip(diffs, scales, strict=True)), (diffs, scales)
    else:
        assert max(diffs) < 1e-5
    assert (got - want).abs().max().item() < 0.05


# actorlm_paged_decode_kv's arguments: the output, then B, Hkv, G and D; n_chunks
_OUT, _N_CHUNKS = 10, 22


def _floats(address: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


def test_soft_capped_scores_in_a_cascade(family_model_factory: Callable[..., Path]) -> None:
    """Gemma 2 through its layers (the fused step, which takes no cascade on a windowed
    model, off): soft-capped scores over fp32 pages take the backend's kernel too; its
    global layers attend in a cascade (its windowed ones cannot: their keys start inside
    a page), and the logits are those of attending row by row."""
    runner = make_runner(family_model_factory("gemma2"), num_pages=400, fused_decode_max_batch=0)
    got, want, _, found = run_shared_prefix(runner, 9, 320, TAILS)
    assert runner.fused is None and found is not None
    assert_cascaded(got, want)
    assert (got - want).abs().max().item() < 1e-4


def test_a_cascade_the_kernels_cannot_take_is_not_taken(
    d64: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks wider than the kernels' rows, or shared tokens that are not whole pages
    before a row's last token, make the kernels attend row by row: the same bits."""
    find = Cascade.find.__func__  # type: ignore[attr-defined]

    def too_wide(cls: type[Cascade], *args: object) -> Cascade | None:
        c = find(cls, *args)
        if c is None or len(c.row_shared) != 12:
            return c
        return Cascade(c.row_shared, np.array([0, 12], np.int64), np.arange(12, dtype=np.int64))

    def not_pages(cls: type[Cascade], *args: object) -> Cascade | None:
        c = find(cls, *args)
        return None if c is None else Cascade(c.row_shared - 1, c.chunk_ptr, c.chunk_rows)

    for bad in (too_wide, not_pages):
        monkeypatch.setattr(Cascade, "find", classmethod(bad))
        for fused in (32, 0):
            runner = make_runner(d64, dtype="bfloat16", num_pages=400, fused_decode_max_batch=fused)
            got, want, _, _ = run_shared_prefix(runner, 12, 256, TAILS)
            assert torch.equal(got, want)
