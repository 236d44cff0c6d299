"""Logit processors: built-ins, the registry, validation, and use through the Sampler."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.extensions.points import LOGIT_PROCESSORS
from actorlm.gpu.logit_processors import BanTokens, LogitProcessor, NoRepeatNgram, build_processors
from actorlm.gpu.sampling import Sampler
from actorlm.messages.sampling import LogitProcessorSpec, SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqStep

from .helpers import Pages, Seq, greedy, make_runner, run_step

CPU = torch.device("cpu")


def seq(prompt: list[int], *specs: LogitProcessorSpec, **params: Any) -> SeqInit:
    sampling = SamplingParams(logit_processors=list(specs), **params)
    return SeqInit(sampling=sampling, token_ids=list(prompt), prompt_len=len(prompt))


def test_builtins_registered() -> None:
    for name in ("ban_tokens", "no_repeat_ngram"):
        assert name in LOGIT_PROCESSORS
        assert LOGIT_PROCESSORS.entry(name).source == "builtin"
    assert LOGIT_PROCESSORS.get("ban_tokens") is BanTokens


def test_ban_tokens_through_sampler() -> None:
    sampler = Sampler(10, CPU)
    spec = LogitProcessorSpec(name="ban_tokens", params={"token_ids": [7, 2]})
    sampler.add("g", seq([1], spec, temperature=0.0))
    sampler.add("s", seq([1], spec, temperature=1.0))
    logits = torch.zeros(2, 10)
    logits[:, 7], logits[:, 2], logits[0, 4] = 9.0, 8.0, 1.0
    for _ in range(20):
        g, s = sampler.sample(["g", "s"], logits)
        assert g.token_id == 4 and s.token_id not in (2, 7)


def _brute_force_banned(tokens: list[int], n: int) -> set[int]:
    prefix = tokens[len(tokens) - n + 1 :] if n > 1 else []
    return {
        tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i : i + n - 1] == prefix
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_brute_force_incrementally(n: int) -> None:
    rng = random.Random(n)
    tokens = [rng.randrange(5) for _ in range(6)]
    proc = NoRepeatNgram({"ngram_size": n})
    for _ in range(30):
        row = proc(tokens, torch.zeros(5))
        banned = {i for i in range(5) if row[i].item() == float("-inf")}
        assert banned == _brute_force_banned(tokens, n)
        tokens.append(rng.randrange(5))


def test_no_repeat_ngram_through_sampler_never_repeats() -> None:
    vocab = 6
    sampler = Sampler(vocab, CPU)
    spec = LogitProcessorSpec(name="no_repeat_ngram", params={"ngram_size": 2})
    sampler.add("r", seq([1, 2, 1], spec, temperature=0.0))
    tokens = [1, 2, 1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(1, vocab, generator=gen)
        logits[0, 2] = 50.0  # the model wants "1 2" again; that bigram is taken
        tokens.append(sampler.sample(["r"], logits)[0].token_id)
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    assert tokens[3] != 2
    assert len(set(bigrams)) == len(bigrams), tokens


@pytest.mark.parametrize(
    "spec,message",
    [
        (LogitProcessorSpec(name="nope"), "unknown logit processor 'nope'; known: .*ban_tokens"),
        (LogitProcessorSpec(name="ban_tokens", params={}), "token_ids must be"),
        (LogitProcessorSpec(name="ban_tokens", params={"token_ids": [-1]}), "token_ids must be"),
        (LogitProcessorSpec(name="ban_tokens", params={"token_ids": "1"}), "token_ids must be"),
        (
            LogitProcessorSpec(name="ban_tokens", params={"token_ids": [100]}),
            "outside the vocabulary",
        ),
        (
            LogitProcessorSpec(name="ban_tokens", params={"token_ids": [1], "x": 1}),
            "unknown parameter",
        ),
        (LogitProcessorSpec(name="no_repeat_ngram", params={"ngram_size": 0}), "ngram_size"),
        (LogitProcessorSpec(name="no_repeat_ngram", params={"ngram_size": True}), "ngram_size"),
    ],
)
def test_bad_specs_rejected_up_front(spec: LogitProcessorSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_processors([spec], 50)


class _OnlyEven(LogitProcessor):
    """A plugin-style processor: sees the sequence so far, allows even tokens only."""

    calls: list[int] = []

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        if set(params) - {"offset"}:
            raise ValueError("only_even: only 'offset' is allowed")

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(token_ids))
        out = logits.clone()  # returning a new tensor must work too
        out[1::2] = float("-inf")
        return out


def test_plugin_processor_sees_growing_sequence() -> None:
    LOGIT_PROCESSORS.register("only_even", _OnlyEven, source="test")
    try:
        sampler = Sampler(8, CPU)
        spec = LogitProcessorSpec(name="only_even")
        sampler.add("r", seq([1, 3, 5], spec, temperature=1.0, seed=0))
        _OnlyEven.calls.clear()
        for _ in range(5):
            assert sampler.sample(["r"], torch.zeros(1, 8))[0].token_id % 2 == 0
        assert _OnlyEven.calls == [3, 4, 5, 6, 7]
    finally:
        LOGIT_PROCESSORS.unregister("only_even")


def test_a_processor_that_refuses_ends_its_request_alone(tiny_llama: Path) -> None:
    """Processors are built once, in the worker: a bad one fails that sequence only (no
    forward for it, no KV written), and its batch neighbour gets the tokens it gets alone."""
    runner = make_runner(tiny_llama)
    prompt = [5, 6, 7, 8]
    alone = greedy(runner, "ok", prompt, 3, Pages(first=100))
    pages = Pages()
    bad = LogitProcessorSpec(name="no_repeat_ngram", params={"ngram_size": 0})
    bad_init = SeqInit(
        sampling=SamplingParams(temperature=0, logit_processors=[bad]),
        token_ids=[9, 9],
        prompt_len=2,
    )
    good = Seq("ok", prompt, pages)
    steps = [SeqStep("bad", [9, 9], 0, pages.table("bad", 2), True, bad_init), good.step()]
    result = runner.forward(ForwardBatch(step_id=0, seqs=steps))
    assert [(e.rid, "ngram_size" in e.message) for e in result.errors] == [("bad", True)]
    assert [r.rid for r in result.results] == ["ok"]
    good.out.append(result.results[0].token_id)
    for i in range(1, 3):
        run_step(runner, [good], [good.step()], i)
    assert good.out == alone
