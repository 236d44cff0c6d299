"""The plugin guide's MoE example (``actorlm_example_plugin/moe.py``: Qwen2-MoE from
actorlm's ``SparseMoE``, shared expert included) against transformers' Qwen2-MoE."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from actorlm.extensions.points import MODELS

from tests.gpu.helpers import (
    assert_greedy_matches_everywhere,
    assert_prefill_logits_match,
    hf_model,
    make_runner,
)

EXAMPLE = Path(__file__).parent / "actorlm_example_plugin" / "actorlm_example_plugin" / "moe.py"


def test_qwen2_moe_from_the_moe_layer_matches_transformers(
    family_model_factory: Callable[..., Path],
) -> None:
    spec = importlib.util.spec_from_file_location("example_moe", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = family_model_factory("qwen2_moe")
    MODELS.register("Qwen2MoeForCausalLM", module.Qwen2MoeForCausalLM, source="example")
    try:
        runner = make_runner(path, num_pages=512, model_impl="native")
        assert runner.model.model.layers[0].mlp.shared_expert is not None
        ref = hf_model(path)
        assert_prefill_logits_match(runner, ref)
        assert_greedy_matches_everywhere(runner, ref)
    finally:
        MODELS.unregister("Qwen2MoeForCausalLM")
