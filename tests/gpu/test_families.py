"""Every native family beyond Llama against transformers on its tiny random model:
prefill logits alone and in a ragged batch, and 32 greedy tokens alone, in a batch
beside other requests, on top of a cached prefix and after a chunked prefill.

The prompts run past Gemma's windows (8 and 16 tokens) and Phi-3's original
context (32 tokens, where LongRoPE switches to its long factors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.gpu.forward_meta import SeqSpec
from actorlm.gpu.runner import ModelRunner

from tests.models import FAMILIES

from .helpers import Pages, Seq, greedy, hf_greedy, hf_last_logits, hf_model, make_runner, run_step

TOL = 1e-4  # fp32 on both sides: same math, other op order; logits are O(10)
STEPS = 32
PROMPT_A = [(i * 7919) % 40000 + 100 for i in range(41)]
PROMPT_B = [(i * 104729) % 40000 + 100 for i in range(37)]
PROMPT_C = PROMPT_A[:32] + [5, 17, 923, 4, 4, 88, 1200, 31, 7]  # A's first two pages, then its own
PROMPT_D = [42, 4242, 424]


@pytest.fixture(scope="module", params=[*FAMILIES, "mistral-window"])
def family(
    request: pytest.FixtureRequest,
    family_model_factory: Callable[..., Path],
    tiny_model_factory: Callable[..., Path],
) -> tuple[ModelRunner, Any]:
    """(our runner, the transformers model) on one family's tiny checkpoint."""
    if request.param == "mistral-window":  # every layer windowed, the window across pages
        path = tiny_model_factory("mistral", sliding_window=20)
    else:
        path = family_model_factory(request.param)
    return make_runner(path, num_pages=512), hf_model(path)


def test_prefill_logits_alone_and_batched(family: tuple[ModelRunner, Any]) -> None:
    runner, ref = family
    prompts = [PROMPT_A, PROMPT_D, PROMPT_B]
    want = [hf_last_logits(ref, p) for p in prompts]
    pages = Pages()
    batched = runner.run(
        [SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        alone = runner.run([SeqSpec(prompt, 0, pages.table(f"s{i}", len(prompt)))])[0]
        assert (alone - want[i]).abs().max().item() < TOL, f"prompt {i} alone"
        assert (batched[i] - want[i]).abs().max().item() < TOL, f"prompt {i} in the batch"


def test_greedy_alone_batched_cached_and_chunked(family: tuple[ModelRunner, Any]) -> None:
    runner, ref = family
    pages = Pages()
    assert greedy(runner, "a", PROMPT_A, STEPS, pages) == hf_greedy(ref, PROMPT_A, STEPS)
    b, c, d = Seq("b", PROMPT_B, pages), Seq("c", PROMPT_C, pages), Seq("d", PROMPT_D, pages)
    # c reuses a's first two pages (its cached prefix, as the radix cache hands it over)
    pages.tables["c"] = pages.tables["a"][:2]
    c.cached = 32
    run_step(runner, [b, c, d], [b.step(chunk=20), c.step(), d.step()])  # b's first chunk
    step = 1
    while any(len(s.out) < STEPS for s in (b, c, d)):
        live = [s for s in (d, b, c) if len(s.out) < STEPS]
        run_step(runner, live, [s.step() for s in live], step)
        step += 1
    for seq in (b, c, d):
        assert seq.out == hf_greedy(ref, seq.prompt, STEPS), seq.rid


def test_windowed_layers_and_experts_are_what_the_config_says(
    family_model_factory: Callable[..., Path],
) -> None:
    gemma3 = make_runner(family_model_factory("gemma3"), num_pages=64)
    assert gemma3.layer_windows == [8, 8, 8, 0]
    assert gemma3.backend.scale == pytest.approx(32**-0.5)
    gemma2 = make_runner(family_model_factory("gemma2"), num_pages=64)
    assert (gemma2.layer_windows, gemma2.softcap) == ([16, 0], 50.0)
    moe = make_runner(family_model_factory("qwen3_moe"), num_pages=64).model
    layer = moe.model.layers[0].mlp
    assert (len(layer.experts), layer.top_k, layer.renormalize) == (8, 2, True)
    x = torch.randn(5, 64)
    weights, ids = layer.route(x)
    assert ids.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.ones(5))
