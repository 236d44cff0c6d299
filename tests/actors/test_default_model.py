"""The embedded default model (SmolLM2-135M-Instruct GGUF) through the Engine."""

from __future__ import annotations

from actorlm import Engine


def test_default_model_answers_the_capital_of_france() -> None:
    with Engine(kv_cache_gb=0.25) as engine:
        out = engine.chat(
            "What is the capital of France?", {"max_new_tokens": 32, "temperature": 0}
        )
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length") and out.usage.prompt_tokens > 10
