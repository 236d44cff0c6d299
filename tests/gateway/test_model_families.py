"""Each model family end to end: ``actorlm serve`` on its tiny model, the real ``openai``
client, the family's own chat template and stop tokens.

Per family (one server each, started in turn): a chat completion whose prompt is
the family's template as transformers renders it and whose greedy tokens are
transformers' on that prompt; a stream that ends at the family's end-of-turn
token (pushed to the top by ``logit_bias``) with finish reason ``stop``; Qwen3's
``enable_thinking`` template argument; the fallback saying at start that it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.helpers import hf_greedy, hf_model
from tests.models import FAMILIES

from .conftest import API_KEY, Server, running_server

END_OF_TURN = {
    "qwen3": "<|im_end|>",
    "qwen3_moe": "<|im_end|>",
    "mixtral": "</s>",
    "gemma2": "<end_of_turn>",
    "gemma3": "<end_of_turn>",
    "phi3": "<|end|>",
    "gpt_neox": "<|im_end|>",  # SmolLM2's tokenizer and template
}
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]
TOKENS = 6


@pytest.fixture(scope="module", params=[*FAMILIES, "gpt_neox"])
def served(
    request: pytest.FixtureRequest,
    family_model_factory: Callable[..., Path],
    tiny_model_factory: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path, Server]]:
    name = request.param
    if name == "gpt_neox":  # not native: the transformers fallback
        path = tiny_model_factory("gpt_neox", rotary_pct=0.25)
    else:
        path = family_model_factory(name)
    log = tmp_path_factory.mktemp(f"serve-{name}") / "serve.log"
    # fp32 weights as loaded: greedy tokens comparable with transformers' on any CPU
    with running_server(path, log, "--quantization", "none", "--dtype", "float32") as srv:
        yield name, path, srv


@pytest.fixture(scope="module")
def tokenizer(served: tuple[str, Path, Server]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(served[1]))


def client(srv: Server) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def prompt_ids(tokenizer: Any, **kwargs: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_uses_the_family_template_and_decodes_like_transformers(
    served: tuple[str, Path, Server], tokenizer: Any
) -> None:
    name, path, srv = served
    reply = client(srv).chat.completions.create(
        model=srv.model, messages=CHAT, temperature=0, max_tokens=TOKENS,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ids = prompt_ids(tokenizer)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == TOKENS
    with torch.inference_mode():
        want = hf_greedy(hf_model(path), ids, TOKENS)
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    if name == "gpt_neox":
        assert "running the transformers fallback" in srv.log_text()
    if name.startswith("qwen3"):  # Qwen3's template argument: an empty thinking block
        reply = client(srv).chat.completions.create(
            model=srv.model, messages=CHAT, temperature=0, max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
        no_thinking = prompt_ids(tokenizer, enable_thinking=False)
        assert reply.usage.prompt_tokens == len(no_thinking) == len(ids) + 4


def test_stream_stops_at_the_family_end_of_turn(
    served: tuple[str, Path, Server], tokenizer: Any
) -> None:
    name, _, srv = served
    stop_id = tokenizer.convert_tokens_to_ids(END_OF_TURN[name])
    stream = client(srv).chat.completions.create(
        model=srv.model, messages=CHAT, temperature=0, max_tokens=TOKENS, stream=True,
        logit_bias={str(stop_id): 100},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
