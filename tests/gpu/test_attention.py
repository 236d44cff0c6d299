"""Ragged paged batches through the CPU attention backends (torch, and cpu with its C
decode kernel): mixing fresh prefills, prefix extensions and decodes must not change
any sequence's result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from actorlm.extensions.points import ATTENTION_BACKENDS
from actorlm.extensions.registry import UnknownNameError
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.kv_pool import KVPool
from actorlm.gpu.runner import ModelRunner

from .helpers import Pages, Seq, greedy, make_runner, run_step

PROMPT_A = list(range(200, 237))  # 37 tokens: 3 pages
PROMPT_B = [9, 8, 7, 6, 5, 4, 3, 2] * 5  # 40 tokens, prefilled in chunks
PROMPT_C = [1000, 2000, 3000, 17]
STEPS = 10


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runner(request: pytest.FixtureRequest, tiny_llama: Path) -> ModelRunner:
    # every step through the backend (the fused step, which attends itself and sums its
    # linears in another order, is tests/gpu/kernels/test_step.py's)
    return make_runner(
        tiny_llama, num_pages=512, attention_backend=request.param, fused_decode_max_batch=0
    )


def test_ragged_batch_gives_same_tokens_as_each_request_alone(runner: ModelRunner) -> None:
    alone = {
        rid: greedy(runner, rid, p, STEPS, Pages(first=300))
        for rid, p in [("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)]
    }
    pages = Pages()
    a, b, c = Seq("a", PROMPT_A, pages), Seq("b", PROMPT_B, pages), Seq("c", PROMPT_C, pages)
    run_step(runner, [a], [a.step()])  # a: fresh prefill
    run_step(runner, [a, b], [b.step(chunk=17), a.step()])  # b: first chunk (no sample), a: decode
    # a decode between b's extension (start_pos 17) and c's fresh prefill
    run_step(runner, [a, b, c], [b.step(), a.step(), c.step()])
    step = 3
    while len(a.out) < STEPS or len(b.out) < STEPS or len(c.out) < STEPS:
        live = [s for s in (c, a, b) if len(s.out) < STEPS]
        run_step(runner, live, [s.step() for s in live], step)  # decodes only, rows reordered
        step += 1
    assert (a.out, b.out, c.out) == (alone["a"], alone["b"], alone["c"])


def test_decode_rows_not_contiguous(runner: ModelRunner) -> None:
    # decodes on either side of a prefill: the backend scatters their rows back
    alone = {
        rid: greedy(runner, rid, p, 3, Pages(first=300))
        for rid, p in [("a", PROMPT_A), ("c", PROMPT_C)]
    }
    pages = Pages()
    a, b, c = Seq("a", PROMPT_A, pages), Seq("b", PROMPT_B, pages), Seq("c", PROMPT_C, pages)
    run_step(runner, [a, c], [a.step(), c.step()])
    run_step(runner, [a, b, c], [a.step(), b.step(), c.step()])
    run_step(runner, [a, c], [a.step(), c.step()])
    assert (a.out, c.out) == (alone["a"], alone["c"])


def test_extending_cached_prefix_matches_full_prefill(runner: ModelRunner) -> None:
    prompt = list(range(500, 545))  # 45 tokens
    full = runner.run([SeqSpec(prompt, 0, [0, 1, 2])])
    # chunked: 23 tokens, then the remaining 22 on top of them
    runner.run([SeqSpec(prompt[:23], 0, [3, 4], sample=False)])
    chunked = runner.run([SeqSpec(prompt[23:], 23, [3, 4, 5])])
    # prefix sharing as the radix cache does it: page 0 (tokens 0-15) reused read-only
    shared = runner.run([SeqSpec(prompt[16:], 16, [0, 6, 7])])
    assert (full - chunked).abs().max().item() < 1e-5
    assert (full - shared).abs().max().item() < 1e-5


def test_pages_saved_and_restored_elsewhere_resume_the_same(runner: ModelRunner) -> None:
    prompt = list(range(700, 733))  # 33 tokens: pages 10, 11, 12
    runner.run([SeqSpec(prompt, 0, [10, 11, 12], sample=False)])
    saved = runner.pool.read_pages_numpy([10, 11, 12])
    assert saved.shape == (
        runner.info.num_layers,
        2,
        runner.info.num_kv_heads,
        3,
        16,
        runner.info.head_dim,
    )
    runner.pool.write_pages_numpy([40, 41, 42], saved)
    resumed = runner.run([SeqSpec([5], 33, [40, 41, 42])])
    original = runner.run([SeqSpec([5], 33, [10, 11, 12])])
    assert torch.equal(resumed, original)
    assert np.array_equal(runner.pool.read_pages_numpy([41]), saved[:, :, :, 1:2])


def test_kv_pool_layout() -> None:
    pool = KVPool(
        num_layers=2, num_pages=4, page_size=8, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16
    )
    k = torch.randn(3, 2, 4)
    pool.write(1, torch.tensor([0, 9, 31]), k, -k)
    # slot 9 = page 1, offset 1; heads lead
    assert torch.equal(pool.k_pages(1)[:, 1, 1], k[1].to(torch.bfloat16))
    assert torch.equal(pool.v_slots(1)[:, 31], (-k[2]).to(torch.bfloat16))
    raw = pool.read_pages_numpy([3])
    assert raw.dtype == np.uint16  # bf16 travels as raw bits
    pool.write_pages_numpy([0], raw)
    assert torch.equal(pool.k_pages(1)[:, 0, 7], k[2].to(torch.bfloat16))


@pytest.mark.parametrize("name", ["flashinfer", "triton"])
def test_cuda_backends_refuse_cpu_clearly(name: str) -> None:
    import actorlm.gpu.attention  # noqa: F401  (registers the built-ins)

    pool = KVPool(1, 1, 16, 1, 8, torch.float32)
    with pytest.raises(
        RuntimeError, match=f"{name}.*needs a CUDA device.*--attention-backend torch"
    ):
        ATTENTION_BACKENDS.get(name)(pool, 1, 8)


def test_unknown_backend_lists_known(tiny_llama: Path) -> None:
    with pytest.raises(UnknownNameError, match="known: cpu, flashinfer, torch, triton"):
        make_runner(tiny_llama, attention_backend="nope")
