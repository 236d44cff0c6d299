"""The transformers fallback (``--model-impl transformers``, and ``auto`` for an
architecture with no native model) against transformers itself: the same checks
as the native families, on GPT-NeoX (not native) and on two native families run
through the fallback (Gemma 2's windows, soft caps and query scale; Qwen3-MoE)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from actorlm.gpu.models.hf_fallback import TransformersCausalLM
from actorlm.gpu.models.registry import resolve_model_impl
from actorlm.gpu.runner import ModelRunner

from .helpers import (
    assert_greedy_matches_everywhere,
    assert_prefill_logits_match,
    hf_model,
    make_runner,
)


@pytest.fixture(scope="module", params=["gpt_neox", "gemma2", "qwen3_moe", "llama_biases"])
def fallback(
    request: pytest.FixtureRequest,
    tiny_model_factory: Callable[..., Path],
    family_model_factory: Callable[..., Path],
) -> tuple[ModelRunner, Any]:
    if request.param == "gpt_neox":  # partial rotary, parallel residual, GELU: not native
        path, impl = tiny_model_factory("gpt_neox", rotary_pct=0.25), "auto"
    elif request.param == "llama_biases":  # o_proj and MLP biases: no native model builds them
        path, impl = tiny_model_factory("llama", attention_bias=True, mlp_bias=True), "auto"
    else:
        path, impl = family_model_factory(request.param), "transformers"
    runner = make_runner(path, num_pages=512, model_impl=impl)
    assert isinstance(runner.model, TransformersCausalLM)
    return runner, hf_model(path)


def test_prefill_logits_alone_and_batched(fallback: tuple[ModelRunner, Any]) -> None:
    assert_prefill_logits_match(*fallback)


def test_greedy_alone_batched_cached_and_chunked(fallback: tuple[ModelRunner, Any]) -> None:
    assert_greedy_matches_everywhere(*fallback)


def test_model_impl_choice() -> None:
    assert resolve_model_impl("Qwen3ForCausalLM") == "native"
    assert resolve_model_impl("GPTNeoXForCausalLM") == "transformers"
    assert resolve_model_impl("Qwen3ForCausalLM", "transformers") == "transformers"
    with pytest.raises(ValueError) as err:
        resolve_model_impl("GPTNeoXForCausalLM", "native")
    message = str(err.value)
    assert "\n" not in message and "--model-impl transformers" in message
    assert "Gemma3ForCausalLM" in message and "Qwen3MoeForCausalLM" in message
    with pytest.raises(ValueError, match="known: auto, native, transformers"):
        resolve_model_impl("Qwen3ForCausalLM", "fast")
    # what a checkpoint has beyond the native model's build sends auto to the fallback
    gaps = ["a bias on o_proj (attention_bias)"]
    assert resolve_model_impl("LlamaForCausalLM", "auto", gaps) == "transformers"
    with pytest.raises(ValueError, match=r"does not build a bias on o_proj \(attention_bias\)"):
        resolve_model_impl("LlamaForCausalLM", "native", gaps)
    # learned attention sinks: no backend computes them, so no fallback serves them
    with pytest.raises(ValueError, match="attention sinks"):
        resolve_model_impl("GptOssForCausalLM")


def test_serve_refuses_an_unknown_native_architecture_in_one_line(
    tiny_model_factory: Callable[..., Path],
) -> None:
    import subprocess
    import sys

    path = tiny_model_factory("gpt_neox", rotary_pct=0.25)
    cmd = [
        sys.executable,
        "-m",
        "actorlm.cli",
        "serve",
        "--model",
        str(path),
        "--model-impl",
        "native",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPTNeoXForCausalLM" in lines[0], done.stderr
    assert "registered: " in lines[0] and "--model-impl transformers" in lines[0]


def test_actorlm_plugins_lists_every_architecture_and_the_fallback() -> None:
    import io

    from actorlm.gpu.models import NATIVE_ARCHITECTURES
    from actorlm.report import print_plugins

    out = io.StringIO()
    print_plugins(out)
    lines = [" ".join(line.split()) for line in out.getvalue().splitlines()]
    for arch in NATIVE_ARCHITECTURES:
        assert f"{arch} [builtin]" in lines, arch
    assert "(any other decoder) [transformers fallback: --model-impl auto|transformers]" in lines
