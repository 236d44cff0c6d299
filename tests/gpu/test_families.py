"""Every native family beyond Llama against transformers on its tiny random model:
prefill logits alone and in a ragged batch, and 32 greedy tokens alone, in a batch
beside other requests, on top of a cached prefix and after a chunked prefill.

The prompts run past Gemma's windows (8 and 16 tokens) and Phi-3's original
context (32 tokens, where LongRoPE switches to its long factors)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.gpu.runner import ModelRunner

from tests.models import FAMILIES

from .helpers import (
    assert_greedy_matches_everywhere,
    assert_prefill_logits_match,
    hf_model,
    make_runner,
)


@pytest.fixture(scope="module", params=[*FAMILIES, "mistral-window", "gemma3-multimodal"])
def family(
    request: pytest.FixtureRequest,
    family_model_factory: Callable[..., Path],
    tiny_model_factory: Callable[..., Path],
) -> tuple[ModelRunner, Any]:
    """(our runner, the transformers model) on one family's tiny checkpoint."""
    if request.param == "mistral-window":  # every layer windowed, the window across pages
        path = tiny_model_factory("mistral", sliding_window=20)
    elif request.param == "gemma3-multimodal":  # served text only, the vision tower skipped
        path = family_model_factory("gemma3", multimodal=True)
    else:
        path = family_model_factory(request.param)
    runner = make_runner(path, num_pages=512)
    assert runner.model.__class__.__module__.startswith("actorlm.gpu.models")  # native
    return runner, hf_model(path)


def test_prefill_logits_alone_and_batched(family: tuple[ModelRunner, Any]) -> None:
    assert_prefill_logits_match(*family)


def test_greedy_alone_batched_cached_and_chunked(family: tuple[ModelRunner, Any]) -> None:
    assert_greedy_matches_everywhere(*family)


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
    weights, ids = layer.route(torch.randn(5, 64))
    assert ids.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.ones(5))


def test_qwen3_with_yarn_long_context_scaling(family_model_factory: Callable[..., Path]) -> None:
    """Qwen3's long-context setting (YaRN, factor 4 over a 16-token original context
    here) on the prompts, which run past it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path = family_model_factory(
        "qwen3", max_position_embeddings=64, rope_parameters={**yarn, "rope_theta": 1e6}
    )
    runner = make_runner(path, num_pages=512)
    assert runner.info.rope_scaling is not None and runner.info.rope_scaling["rope_type"] == "yarn"
    assert runner.model.ropes[0].attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    assert_prefill_logits_match(runner, hf_model(path))


def test_stacked_experts_equal_the_reference_loop(
    family_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default experts kernel (dense weights stacked: one token's experts directly,
    padded bmm, or per-expert GEMMs when routing is uneven) against ``grouped_experts``,
    in fp32, to rounding (the k results are summed in one weighted pass)."""
    from actorlm.gpu.models import moe as moe_module

    layer = make_runner(family_model_factory("mixtral"), num_pages=64).model.model.layers[0].mlp
    torch.manual_seed(0)
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, 64)
        weights, ids = layer.route(x)
        want = moe_module.grouped_experts(layer, x, weights, ids)
        padded = moe_module.stacked_experts(layer, x, weights, ids)
        with monkeypatch.context() as m:  # no padding allowed: the per-expert path
            m.setattr(moe_module, "_MAX_PADDING", 0.0)
            m.setattr(moe_module, "_SMALL_PADDED_MACS", 0)
            looped = moe_module.stacked_experts(layer, x, weights, ids)
        torch.testing.assert_close(padded, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(looped, want, rtol=1e-5, atol=1e-5)
    gate_up, _ = layer.dense_experts()
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()  # a view
