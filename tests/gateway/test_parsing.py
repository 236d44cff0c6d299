"""Request parsing, response shapes and error mapping: pure functions, no server."""

from __future__ import annotations

import pytest
from actorlm.config import EngineConfig, LoraConfig, ModelConfig
from actorlm.gateway.errors import ApiError
from actorlm.gateway.native import parse_generate
from actorlm.gateway.openai import (
    Choice,
    chat_logprob_entries,
    chunk,
    completion_logprobs,
    full_response,
)
from actorlm.gateway.openai_parse import parse_chat, parse_completion
from actorlm.gateway.params import ModelLimits
from actorlm.gateway.state import GatewayState
from actorlm.gateway.streams import delta_error
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import TextDelta, TokenLogprob, Usage


@pytest.fixture()
def state() -> GatewayState:
    config = EngineConfig(model=ModelConfig(path="/models/tiny", served_model_name="tiny"))
    return GatewayState(config, ModelLimits(vocab_size=1000, max_model_len=256))


def _err(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_completion_fans_out_prompts_and_choices(state: GatewayState) -> None:
    job = parse_completion(
        {
            "model": "tiny",
            "prompt": ["a", "b"],
            "n": 2,
            "seed": 7,
            "max_tokens": 9,
            "stop": "x",
            "top_k": 5,
        },
        state,
    )
    assert [r.rid for r in job.reqs] == [f"{job.id}-{i}" for i in range(4)]
    assert [r.text for r in job.reqs] == ["a", "a", "b", "b"]
    assert [r.sampling.seed for r in job.reqs] == [7, 8, 7, 8]
    s = job.reqs[0].sampling
    assert (s.max_new_tokens, s.stop, s.top_k, s.n) == (9, ["x"], 5, 1)


def test_completion_token_prompts_and_defaults(state: GatewayState) -> None:
    job = parse_completion({"prompt": [1, 2, 3]}, state)
    assert job.reqs[0].input_ids == [1, 2, 3]
    assert job.reqs[0].sampling.max_new_tokens == 16  # OpenAI's default for completions
    assert job.reqs[0].sampling.fit_context  # a default: lowered to what the prompt leaves
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(chat, state).reqs[0].sampling.fit_context
    asked = parse_chat({**chat, "max_tokens": 5}, state).reqs[0].sampling
    assert (asked.max_new_tokens, asked.fit_context) == (5, False)
    job = parse_completion({"prompt": [[1], [2, 3]], "logprobs": 3}, state)
    assert [r.input_ids for r in job.reqs] == [[1], [2, 3]]
    assert job.reqs[0].sampling.logprobs and job.reqs[0].sampling.top_logprobs == 3


def test_chat_parsing(state: GatewayState) -> None:
    body = {
        "model": "default",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_completion_tokens": 5,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {"17": -100},
        "min_tokens": 2,
    }
    job = parse_chat(body, state)
    req = job.reqs[0]
    assert req.messages is not None and req.messages[1].content == "hi"
    assert req.sampling.max_new_tokens == 5 and req.sampling.min_new_tokens == 2
    assert req.sampling.logit_bias == {17: -100.0} and req.sampling.top_logprobs == 2


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ([1, 2], 400, "JSON object"),
        ({"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": "x", "temperature": True}, 400, "'temperature' must be a number"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n must be >= 1"),
        ({"prompt": "x", "max_tokens": 10_000}, 400, "256"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "token ids"),
        ({"prompt": "x", "logit_bias": {"5000": 1}}, 400, "vocabulary"),
        ({"prompt": "x", "logprobs": 50}, 400, "top_logprobs"),
        ({"prompt": "x", "stop": [1]}, 400, "'stop'"),
        ({"prompt": "x", "seed": 2**70}, 400, "out of range"),
        ({"prompt": []}, 400, "'prompt'"),
        ({"prompt": "x", "echo": True}, 400, "echo"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ],
)
def test_completion_errors(state: GatewayState, body: object, status: int, needle: str) -> None:
    err = _err(parse_completion, body, state)
    assert err.status == status
    assert needle in err.message
    payload = err.payload()["error"]
    assert set(payload) >= {"message", "type", "code"}


@pytest.mark.parametrize("prompt", [[True], [1, "a"], [[1], [2.5]]])
def test_bad_token_prompts_name_the_prompt(state: GatewayState, prompt: object) -> None:
    err = _err(parse_completion, {"prompt": prompt}, state)
    assert err.status == 400 and err.param == "prompt", err.payload()


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    ],
)
def test_chat_errors(state: GatewayState, body: object) -> None:
    assert _err(parse_chat, body, state).status == 400


def test_native_generate_parsing(state: GatewayState) -> None:
    job = parse_generate(
        {
            "text": "hi",
            "rid": "r1",
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["\n"], "n": 2},
        },
        state,
    )
    assert [r.rid for r in job.reqs] == ["r1-0", "r1-1"]
    s = job.reqs[0].sampling
    assert (s.max_new_tokens, s.temperature, s.stop, s.top_logprobs, s.n) == (4, 0.0, ["\n"], 2, 1)
    assert (
        _err(parse_generate, {"text": "x", "sampling_params": {"max_tokens": 3}}, state).status
        == 400
    )
    assert _err(parse_generate, {"text": "x", "input_ids": [1]}, state).status == 400
    no_lora = _err(parse_generate, {"text": "x", "lora_path": "a"}, state)
    assert no_lora.status == 404 and "--enable-lora" in no_lora.message


def test_adapters_are_named_by_lora_path_or_model(state: GatewayState) -> None:
    assert parse_generate({"text": "x", "lora_path": ""}, state).reqs[0].lora_path is None
    assert _err(parse_completion, {"prompt": "x", "model": "a"}, state).status == 404
    lora = EngineConfig(model=state.config.model, lora=LoraConfig(enable_lora=True))
    state = GatewayState(lora, state.limits)
    assert parse_generate({"text": "x", "lora_path": "a"}, state).reqs[0].lora_path == "a"
    job = parse_completion({"prompt": "x", "model": "a", "n": 2}, state)
    assert [r.lora_path for r in job.reqs] == ["a", "a"] and job.model == "a"
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "model": "a"}, state)
    assert chat.reqs[0].lora_path == "a"
    base = parse_completion({"prompt": "x", "model": "tiny"}, state)  # the base model's name
    assert base.reqs[0].lora_path is None and base.model == "tiny"


def test_response_shapes(state: GatewayState) -> None:
    job = parse_completion(
        {"prompt": "x", "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}},
        state,
    )
    choice = Choice(0)
    lp = TokenLogprob("ab", 5, -0.5, [("ab", 5, -0.5)])
    first = TextDelta(rid="r", text="ab", token_ids=[5], logprobs=[lp])
    choice.add(first)
    event = chunk(job, choice, first)
    assert event["object"] == "text_completion" and event["usage"] is None
    assert event["choices"][0]["logprobs"] == completion_logprobs([lp], 0)
    last = TextDelta(
        rid="r",
        text="c",
        token_ids=[6],
        logprobs=[lp],
        finish_reason="length",
        usage=Usage(3, 2, 1),
    )
    choice.add(last)
    assert chunk(job, choice, last)["choices"][0]["logprobs"]["text_offset"] == [2]
    full = full_response(job, [choice])
    assert full["choices"][0]["text"] == "abc"
    assert full["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_logprob_bytes_and_offsets_follow_the_raw_bytes() -> None:
    # "é!" as a lead byte, a continuation, then "!": OpenAI's bytes rebuild the text,
    # and both halves of the character sit at its offset
    parts = [("\ufffd", b"\xc3"), ("\ufffd", b"\xa9"), ("!", b"!")]
    lps = [TokenLogprob(t, i, -1.0, [(t, i, -1.0)], raw, [raw]) for i, (t, raw) in enumerate(parts)]
    entries = chat_logprob_entries(lps)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "é!"
    assert entries[1]["top_logprobs"][0]["bytes"] == [0xA9]
    assert completion_logprobs(lps, 4)["text_offset"] == [4, 4, 5]
    # a character begun in an earlier delta (its text held back) starts this one's text
    assert completion_logprobs(lps[1:], 4)["text_offset"] == [4, 4]


def test_error_deltas_keep_their_status() -> None:
    err = delta_error(
        TextDelta(
            rid="r",
            finish_reason="error",
            error="maximum context length is 8",
            error_code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        )
    )
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert (
        delta_error(
            TextDelta(
                rid="r",
                finish_reason="error",
                error="worker died",
                error_code=ErrorCode.UNAVAILABLE,
            )
        ).status
        == 503
    )


def test_logit_processors_are_chosen_by_name_with_params() -> None:
    from actorlm.gateway.params import Fields, native_sampling

    sp = native_sampling(
        Fields({"logit_processors": [{"name": "ban_tokens", "params": {"token_ids": [5]}}, "x"]})
    )
    assert [(p.name, p.params) for p in sp.logit_processors] == [
        ("ban_tokens", {"token_ids": [5]}),
        ("x", {}),
    ]
    with pytest.raises(ApiError):
        native_sampling(Fields({"logit_processors": [{"name": "x", "code": "import os"}]}))
