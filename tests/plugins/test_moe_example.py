"""The plugin guide's MoE example (``actorlm_example_plugin/moe.py``: Qwen2-MoE from
actorlm's ``SparseMoE``, shared expert included) against transformers' Qwen2-MoE."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from actorlm.extensions.points import MODELS
from actorlm.gpu.forward_meta import SeqSpec

from tests.gpu.helpers import (
    Pages,
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
    out = []
    try:
        runner = make_runner(path, num_pages=512, model_impl="native")
        assert runner.model.model.layers[0].mlp.shared_expert is not None
        fused = runner.fused  # registered with llama_spec: the shared expert in the step
        assert fused is not None and all(
            x.moe is not None and x.moe.shared_gate is not None and x.gate_up is not None
            for x in fused.step.weights.layers
        )
        ref = hf_model(path)
        assert_prefill_logits_match(runner, ref)
        assert_greedy_matches_everywhere(runner, ref)
        # a batch of decodes through the step against the model's own layers
        plain = make_runner(path, num_pages=512, model_impl="native", fused_decode_max_batch=0)
        prompts = [
            [(7 * i + 3 * j) % 1000 + 1 for j in range(1 + (i * 13) % 40)] for i in range(16)
        ]
        for r in (runner, plain):
            pages = Pages()
            r.run([SeqSpec(p, 0, pages.table(f"r{i}", len(p))) for i, p in enumerate(prompts)])
            steps = [
                SeqSpec([5 + i], len(p), pages.table(f"r{i}", len(p) + 1))
                for i, p in enumerate(prompts)
            ]
            assert fused.accepts(steps)
            out.append(r.run(steps))
        assert (out[0] - out[1]).abs().max().item() < 1e-4
    finally:
        MODELS.unregister("Qwen2MoeForCausalLM")
