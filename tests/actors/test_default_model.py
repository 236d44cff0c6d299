"""The embedded default model (SmolLM2-135M-Instruct GGUF) through the Engine."""

from __future__ import annotations

from actorlm import Engine


def test_default_model_answers_the_capital_of_france() -> None:
    """Asked "What is the capital of France?", the 135M model's first token is a near
    tie ("The" 0.09 logits above "L'" on the exact fp32 path), which the CPU defaults'
    approximations (bf16, or int8 rows on VNNI) tip either way with any change of
    summation order; this phrasing leaves ~1.5 between its first two (2-core Ice Lake,
    exact fp32 and both int8 paths alike)."""
    with Engine(kv_cache_gb=0.25) as engine:
        out = engine.chat("Name the capital of France.", {"max_new_tokens": 32, "temperature": 0})
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length") and out.usage.prompt_tokens > 10
