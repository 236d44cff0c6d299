"""Incremental detokenization, stop strings and logprob strings on SmolLM2's real tokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from actorlm.actors.tokenizer.detokenize import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
    detokenize_batch,
    stream_batch,
    token_logprobs,
)
from actorlm.actors.tokenizer.tokenization import TextTokenizer, load_tokenizer
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import TopLogprob

TEXTS = [
    "Héllo wörld! 🙂👍🏽 日本語のテキスト 中文  \n\n\t  tabs   and spaces ñandú",
    "Ελληνικά العربية עברית हिन्दी 한국어 — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑‍🚀🏳️‍🌈",
    "def f(x):\n    return x  # ok\n\n\n    \t\n",
    "   leading and trailing spaces   ",
    "plain ascii text, nothing special.",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> TextTokenizer:
    return load_tokenizer(str(tokenizer_dir))


def stream(tok: TextTokenizer, ids: Sequence[int], chunk: int = 1, **kw: bool) -> list[str]:
    d = IncrementalDetokenizer(tok, **kw)
    parts = [d.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*parts, d.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_decode(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    parts = stream(tok, ids)
    assert "".join(parts) == tok.hf.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)


def test_chunked_feeds_match_decode(tok: TextTokenizer) -> None:
    rng = random.Random(0)
    ids = tok.encode("".join(TEXTS))
    for chunk in (2, 3, 5, 64):
        parts = stream(tok, ids, chunk)
        assert "".join(parts) == "".join(TEXTS)
        assert not any("\ufffd" in p for p in parts)
    # Uneven chunks, as a real TokenBatch may carry.
    d, parts, i = IncrementalDetokenizer(tok), [], 0
    while i < len(ids):
        n = rng.randint(0, 4)
        parts.append(d.step(ids[i : i + n]))
        i += n
    assert "".join(parts) + d.finish() == "".join(TEXTS)


def test_split_character_is_held_then_completed(tok: TextTokenizer) -> None:
    byte_ids = tok.hf.convert_tokens_to_ids(["ð", "Ł", "Ļ", "Ĥ"])  # 🙂, one byte per token
    assert stream(tok, byte_ids) == ["", "", "", "🙂", ""]
    # A character cut off by the end of the output is flushed as decode shows it.
    parts = stream(tok, [*tok.encode("ok"), *byte_ids[:2]])
    assert "".join(parts) == tok.hf.decode([*tok.encode("ok"), *byte_ids[:2]]) == "ok\ufffd"
    assert "\ufffd" not in "".join(parts[:-1])
    # Text before an incomplete character is not held back with it.
    d = IncrementalDetokenizer(tok)
    assert d.step([*tok.encode("ok"), *byte_ids[:2]]) == "ok"
    assert d.step(byte_ids[2:]) == "🙂"


def test_special_tokens(tok: TextTokenizer) -> None:
    ids = [1, *tok.encode("Hi there"), 2, 2, *tok.encode(" bye")]
    assert "".join(stream(tok, ids)) == "Hi there bye"
    kept = stream(tok, ids, skip_special_tokens=False)
    assert "".join(kept) == tok.decode(ids, skip_special_tokens=False)
    assert "".join(kept) == "<|im_start|> Hi there <|im_end|> <|im_end|>  bye"
    joined = stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(joined) == tok.hf.decode(ids, skip_special_tokens=False)
    assert "".join(joined) == "<|im_start|>Hi there<|im_end|><|im_end|> bye"


def test_batch_decodes_once_per_step(tok: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    all_ids = [tok.encode(TEXTS[i % len(TEXTS)] * (1 + i % 3)) for i in range(64)]
    calls: list[int] = []
    real = tok.decode_windows

    def counting(windows: Sequence[Sequence[int]]) -> list[str]:
        calls.append(sum(len(w) for w in windows))
        return real(windows)

    monkeypatch.setattr(tok, "decode_windows", counting)
    dets = [IncrementalDetokenizer(tok) for _ in all_ids]
    out = ["" for _ in all_ids]
    steps = max(len(ids) for ids in all_ids)
    for s in range(steps):
        for k, text in enumerate(detokenize_batch(dets, [ids[s : s + 1] for ids in all_ids])):
            out[k] += text
    assert len(calls) == steps
    # Sliding windows: the ids decoded grow linearly with the output, not quadratically.
    assert sum(calls) < 8 * sum(len(ids) for ids in all_ids)
    for k, d in enumerate(dets):
        assert out[k] + d.finish() == tok.hf.decode(all_ids[k])


def test_stop_matcher_never_releases_part_of_a_stop() -> None:
    rng = random.Random(1)
    text = "the cat sat on the mat; STOP! then more STOP text"
    for stop in ["STOP", "the mat", "at", ";", "not there", "t; S"]:
        for _ in range(20):
            m, released, i = StopStringMatcher([stop]), [], 0
            while i < len(text) and m.matched is None:
                n = rng.randint(1, 6)
                released.append(m.push(text[i : i + n]))
                i += n
            at = text.find(stop)
            if at >= 0:
                assert m.matched == stop and "".join(released) == text[:at]
            else:
                assert m.matched is None and "".join(released) + m.flush() == text
            # What was released at any time is a prefix of the answer: nothing to take back.
            assert stop not in "".join(released)


def test_stop_matcher_picks_earliest_and_holds_partial() -> None:
    m = StopStringMatcher(["world", "lo w", ""])
    assert m.push("Hel") == "He"  # "l" may start "lo w"
    assert m.push("lo wo") == "l"
    assert m.matched == "lo w"
    assert m.push("more") == ""
    m = StopStringMatcher(["xyz"])
    assert m.push("abcx") == "abc"
    assert m.flush() == "x"


def test_stop_string_spanning_tokens(tok: TextTokenizer) -> None:
    text = "The answer is 42. END of story"
    ids = tok.encode(text)
    stop = "swer is 4"
    assert not any(stop in tok.token_text(i) for i in ids)  # spans several tokens
    s = TextStream(tok, SamplingParams(stop=[stop, "never"]))
    outs = [s.step([i]) for i in ids]
    body = "".join(o.text for o in outs)
    assert body == "The an"
    (last,) = [o for o in outs if o.finish_reason]
    assert (last.finish_reason, last.matched_stop, last.stop_string_hit) == ("stop", stop, True)
    assert outs[-1].text == "" and s.finished
    assert s.step(ids[:1], "stop").text == ""


def test_stop_string_found_in_final_flush(tok: TextTokenizer) -> None:
    ids = tok.encode("abc ")
    byte_ids = tok.hf.convert_tokens_to_ids(["ð", "Ł", "Ļ"])  # an unfinished emoji
    s = TextStream(tok, SamplingParams(stop=["c \ufffd"]))
    assert s.step(ids).text == "ab"
    out = s.step(byte_ids, "length")
    assert (out.text, out.finish_reason, out.matched_stop) == ("", "stop", "c \ufffd")


def test_stop_tokens_are_not_rendered(tok: TextTokenizer) -> None:
    ids = tok.encode("Fine, thanks")
    s = TextStream(tok, SamplingParams(skip_special_tokens=False))
    outs = [s.step([i]) for i in ids] + [s.step([2], "stop")]
    assert "".join(o.text for o in outs) == "Fine, thanks"
    assert (outs[-1].finish_reason, outs[-1].matched_stop) == ("stop", 2)
    comma = tok.encode(",")[0]
    s = TextStream(tok, SamplingParams(stop_token_ids=[comma]))
    out = s.step(ids[:2], "stop")
    assert (out.text, out.matched_stop) == ("Fine", comma)
    # With ignore_eos, eos is just a (skipped) special token, not a matched stop.
    s = TextStream(tok, SamplingParams(ignore_eos=True))
    out = s.step([*ids, 2], "length")
    assert (out.text, out.finish_reason, out.matched_stop) == ("Fine, thanks", "length", None)


def test_length_finish_flushes_held_text(tok: TextTokenizer) -> None:
    s = TextStream(tok, SamplingParams(stop=["thanks a lot"]))
    ids = tok.encode("Fine, thanks")
    assert "".join(s.step([i]).text for i in ids) == "Fine, "
    out = s.step([], "length")
    assert (out.text, out.finish_reason, out.matched_stop) == ("thanks", "length", None)


def test_stream_batch_many_requests(tok: TextTokenizer) -> None:
    streams, all_ids = [], []
    for i in range(64):
        stop = ["tabs"] if i % 2 else []
        streams.append(TextStream(tok, SamplingParams(stop=stop)))
        all_ids.append(tok.encode(TEXTS[i % len(TEXTS)]))
    texts = ["" for _ in streams]
    reasons: list[str | None] = [None for _ in streams]
    for step in range(max(map(len, all_ids))):
        batch = [ids[step : step + 1] for ids in all_ids]
        finish = [("length" if step == len(ids) - 1 else None) for ids in all_ids]
        for k, out in enumerate(stream_batch(streams, batch, finish)):
            texts[k] += out.text
            reasons[k] = out.finish_reason or reasons[k]
    for k, text in enumerate(texts):
        full = TEXTS[k % len(TEXTS)]
        if k % 2 and "tabs" in full:
            assert (text, reasons[k]) == (full[: full.find("tabs")], "stop")
        else:
            assert (text, reasons[k]) == (full, "length")


def test_token_logprobs(tok: TextTokenizer) -> None:
    ids = tok.encode("Hi 🙂")
    tops = [[TopLogprob(i, -0.1), TopLogprob(2, -3.0)] for i in ids]
    lps = token_logprobs(tok, ids, [-0.1] * len(ids), tops)
    assert lps is not None
    assert [lp.token for lp in lps] == [tok.hf.decode([i]) for i in ids]
    assert lps[0].token_id == ids[0] and lps[0].logprob == -0.1
    assert lps[0].top == [(lps[0].token, ids[0], -0.1), ("<|im_end|>", 2, -3.0)]
    assert b"".join(lp.raw for lp in lps) == "Hi 🙂".encode()
    assert lps[-1].top_raw == [lps[-1].raw, b"<|im_end|>"]
    # 🙂 a byte a token: each shows "\ufffd", their raw bytes make it up again
    split = tok.hf.convert_tokens_to_ids(["ð", "Ł", "Ļ", "Ĥ"])
    lps = token_logprobs(tok, split, [-0.1] * 4) or []
    assert [lp.token for lp in lps] == ["\ufffd"] * 4
    assert b"".join(lp.raw for lp in lps) == "🙂".encode()
    assert token_logprobs(tok, ids, None) is None
    assert [lp.top for lp in token_logprobs(tok, ids, [0.0] * len(ids)) or []] == [[]] * len(ids)
