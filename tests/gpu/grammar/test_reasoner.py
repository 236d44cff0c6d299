"""The reasoner: a constraint applies after the thinking, which starts where the prompt
says (an open think block, a closed one, or neither: forced or undecided)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from actorlm.gpu.grammar import BaseGrammarBackend
from actorlm.gpu.grammar.reasoner import ReasonerGrammarObject, ThinkTokens

from .conftest import EOS, VOCAB, allowed

START, END = 1000, 1001  # stand-ins for <think> and </think>
THINK = ThinkTokens(START, END)


def mask_of(grammar: ReasonerGrammarObject) -> list[int]:
    out = torch.empty(1, (VOCAB + 31) // 32, dtype=torch.int32)
    grammar.fill_vocab_mask(out, 0)
    return allowed(out[0])


@pytest.mark.parametrize(
    ("prompt", "think", "state"),
    [
        ([5, START, 6], THINK, "thinking"),
        ([5, START, 6, END, 7], THINK, "answer"),
        ([5, 6], THINK, "undecided"),
        ([5, 6], ThinkTokens(START, END, forced=True), "thinking"),
    ],
)
def test_where_thinking_starts(prompt: list[int], think: ThinkTokens, state: str) -> None:
    assert think.initial_state(prompt) == state


def test_the_constraint_starts_after_the_thinking(
    make_backend: Callable[[str], BaseGrammarBackend],
) -> None:
    inner = make_backend("xgrammar").dispatch("regex", "[0-9]")
    digits = mask_of(ReasonerGrammarObject(inner.copy(), THINK, "answer"))
    grammar = ReasonerGrammarObject.for_prompt(inner.copy(), THINK, [5, START])
    assert not grammar.constrains_next and len(mask_of(grammar)) == VOCAB
    for token in (7, 8, 9, EOS):  # anything while thinking, the stop token too
        assert grammar.accept_token(token)
    assert grammar.accept_token(END)
    assert grammar.constrains_next and mask_of(grammar) == digits
    grammar.rollback(2)  # back into the thinking
    assert not grammar.constrains_next
    assert grammar.accept_token(END) and mask_of(grammar) == digits


def test_undecided_allows_the_answer_or_a_think_start(
    make_backend: Callable[[str], BaseGrammarBackend],
) -> None:
    inner = make_backend("llguidance").dispatch("regex", "[0-9]")
    digits = mask_of(ReasonerGrammarObject(inner.copy(), THINK, "answer"))
    grammar = ReasonerGrammarObject.for_prompt(inner, THINK, [5])
    assert mask_of(grammar) == sorted([*digits, START])
    fork = grammar.copy()
    assert fork.accept_token(START) and not fork.constrains_next
    assert grammar.accept_token(digits[0])  # answered at once: the constraint holds
    assert mask_of(grammar) == [EOS]
