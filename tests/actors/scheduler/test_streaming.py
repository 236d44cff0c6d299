"""The scheduler's stream interval (``StreamBuffer``): which of a step's token deltas go
to the tokenizer now, and which wait for the next ones."""

from __future__ import annotations

from actorlm.actors.scheduler.streaming import StreamBuffer, merge_deltas
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import TokenDelta


def step(i: int, rids: list[str]) -> list[TokenDelta]:
    return [TokenDelta(rid=r, token_ids=[i], logprobs=[-float(i)]) for r in rids]


def test_interval_one_passes_every_delta_through() -> None:
    buf = StreamBuffer(1)
    deltas = step(0, ["a", "b"])
    assert buf.take(deltas) is deltas
    assert not buf.held and not buf.started


def test_first_token_at_once_then_n_at_a_time_and_the_rest_with_the_last() -> None:
    buf = StreamBuffer(3)
    sent = [buf.take(step(i, ["a"])) for i in range(6)]
    assert [[d.token_ids for d in s] for s in sent] == [[[0]], [], [], [[1, 2, 3]], [], []]
    assert sent[3][0].logprobs == [-1.0, -2.0, -3.0]
    last = buf.take([TokenDelta(rid="a", token_ids=[6], logprobs=[-6.0], finish_reason="length")])
    assert [(d.token_ids, d.logprobs, d.finish_reason) for d in last] == [
        ([4, 5, 6], [-4.0, -5.0, -6.0], "length")
    ]
    assert not buf.held and not buf.started


def test_requests_are_held_apart_and_an_error_goes_out_at_once() -> None:
    buf = StreamBuffer(4)
    buf.take(step(0, ["a", "b"]))
    buf.take(step(1, ["a", "b"]))
    err = TokenDelta(rid="b", error="the worker died", error_code=ErrorCode.UNAVAILABLE)
    out = buf.take([err, *step(2, ["a"])])
    assert [(d.rid, d.token_ids, d.error) for d in out] == [("b", [1], "the worker died")]
    assert buf.held["a"].token_ids == [1, 2]
    buf.forget("a")  # a stop string ended it without a last delta
    assert not buf.held and not buf.started


def test_merge_keeps_the_later_delta_s_word_on_the_request() -> None:
    a = TokenDelta(rid="a", token_ids=[1], prompt_tokens=7, cached_tokens=4)
    b = TokenDelta(rid="a", token_ids=[2], finish_reason="stop", grammar_backend="xgrammar")
    m = merge_deltas(a, b)
    assert (m.token_ids, m.logprobs, m.top_logprobs) == ([1, 2], None, None)
    assert (m.prompt_tokens, m.cached_tokens, m.finish_reason, m.grammar_backend) == (
        7,
        4,
        "stop",
        "xgrammar",
    )
