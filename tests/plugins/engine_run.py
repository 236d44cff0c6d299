"""Run by the plugin tests in a subprocess (plugins on PYTHONPATH): one Engine,
every request the tests check, the results as JSON on stdout.

``python engine_run.py MODEL_DIR STORAGE_DIR``
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from typing import Any

from actorlm import Engine
from actorlm.actors.client import RequestFailed
from actorlm.extensions.plugins import plugin_report

__all__: list[str] = []


def _out(o: Any) -> dict[str, Any]:
    return {
        "token_ids": o.token_ids,
        "finish_reason": o.finish_reason,
        "completion_tokens": o.usage.completion_tokens,
        "cached_tokens": o.usage.cached_tokens,
    }


def _failure(engine: Engine, prompt: Any, **kw: Any) -> dict[str, Any]:
    try:
        engine.generate(prompt, {"max_new_tokens": 2}, **kw)
    except RequestFailed as exc:
        return {"message": str(exc), "status": exc.status}
    return {"message": "", "status": 200}


def main() -> None:
    model_dir, storage_dir = sys.argv[1], sys.argv[2]
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49000) for _ in range(150)] for _ in range(6)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    out: dict[str, Any] = {"pid": os.getpid()}
    with Engine(
        model_dir,
        load_format="example_safetensors",
        attention_backend="example_counting",
        eviction_policy="example_oldest_first",
        hicache_storage_backend="example_recording",
        hicache_storage_dir=storage_dir,
        grammar_backend="example_recording_grammar",
        num_pages=32,  # 512 tokens: the six prompts below cannot all stay cached
        page_size=16,
        plugin_config={"example": {"greeting": "hello"}},  # --plugin-config example.greeting=hello
        dtype="float32",  # compared with fp32 transformers (auto is bf16 on some CPUs)
    ) as engine:
        out["reference_prompt"] = prompts[0][:32]
        out["reference"] = _out(engine.generate(prompts[0][:32], {**greedy, "max_new_tokens": 6}))
        out["capped"] = _out(engine.generate(prompts[0][:40], {**greedy, "max_new_tokens": 30}))
        out["forbidden"] = _failure(engine, "say something FORBIDDEN")
        out["negative_priority"] = _failure(engine, "hello", priority=-1)
        out["after_rejects"] = _out(engine.generate("hello there", {**greedy, "max_new_tokens": 4}))
        force = [{"name": "example_force_token", "params": {"token_id": 42}}]
        out["forced"] = _out(
            engine.generate(prompts[1][:20], {"max_new_tokens": 5, "logit_processors": force})
        )
        constrained = engine.generate(prompts[2][:20], {"max_new_tokens": 8, "regex": "[0-9]{3}"})
        out["constrained"] = {
            **_out(constrained),
            "text": constrained.text,
            "grammar_backend": constrained.grammar_backend,
        }
        try:
            engine.generate("hello", {"max_new_tokens": 2, "logit_processors": [
                {"name": "example_force_token", "params": {"token_id": -3}}]})  # fmt: skip
            out["bad_processor"] = {"message": "", "status": 200}
        except RequestFailed as exc:
            out["bad_processor"] = {"message": str(exc), "status": exc.status}
        # More prompts than the pool holds: the plugin's eviction policy has to choose.
        out["pressure"] = [
            _out(engine.generate(p, {**greedy, "max_new_tokens": 4})) for p in prompts
        ]
        out["flushed"] = engine.flush_cache()
        # Its pages left the tree; the plugin's storage backend gives them back.
        out["again"] = _out(engine.generate(prompts[0], {**greedy, "max_new_tokens": 4}))
        out["stats"] = engine.stats()
    report = plugin_report()  # the Engine's own process loaded the plugins too
    out["report"] = dataclasses.asdict(report) if report is not None else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
