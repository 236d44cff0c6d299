"""Reasoning-aware constraints (the seeds' reasoner backend): a constraint applies to
the answer, not to the thinking before it.

``ReasonerGrammarObject`` wraps any grammar object. While the model thinks, every
token is allowed and the inner grammar sees nothing; the think-end token ends the
thinking and hands over to the inner grammar. Where thinking starts is read from
the prompt, as the tokenizer's reasoning parser reads it:

- the prompt's last think token is ``<think>`` (a template opened it): thinking;
- it is ``</think>`` (a template closed it, e.g. thinking turned off): the answer;
- no think token, and the format is *forced* (DeepSeek-R1: the output starts in
  thinking without writing ``<think>``): thinking;
- otherwise undecided: the first token may be ``<think>`` (then thinking) or the
  answer's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import BaseGrammarObject

__all__ = ["ReasonerGrammarObject", "ThinkTokens"]

_THINKING, _UNDECIDED, _ANSWER = "thinking", "undecided", "answer"


@dataclass(frozen=True)
class ThinkTokens:
    start: int
    end: int
    forced: bool = False  # the output starts in thinking without a start token

    def initial_state(self, prompt_ids: Sequence[int]) -> str:
        for token in reversed(prompt_ids):
            if token == self.start:
                return _THINKING
            if token == self.end:
                return _ANSWER
        return _THINKING if self.forced else _UNDECIDED


class ReasonerGrammarObject(BaseGrammarObject):
    def __init__(self, inner: BaseGrammarObject, think: ThinkTokens, state: str) -> None:
        self.inner = inner
        self.think = think
        self.state = state
        # Per accepted token: the state before it and whether the inner grammar took it,
        # so a rollback can undo exactly what it did.
        self._history: list[tuple[str, bool]] = []

    @classmethod
    def for_prompt(
        cls, inner: BaseGrammarObject, think: ThinkTokens, prompt_ids: Sequence[int]
    ) -> ReasonerGrammarObject:
        return cls(inner, think, think.initial_state(prompt_ids))

    @property
    def thinking(self) -> bool:
        return self.state == _THINKING

    @property
    def constrains_next(self) -> bool:
        return self.state != _THINKING

    def accept_token(self, token: int) -> bool:
        before = self.state
        if before == _THINKING:
            if token == self.think.end:
                self.state = _ANSWER
            self._history.append((before, False))
            return True
        if before == _UNDECIDED and token == self.think.start:
            self.state = _THINKING
            self._history.append((before, False))
            return True
        self.state = _ANSWER
        ok = self.inner.accept_token(token)
        if ok:
            self._history.append((before, True))
        else:
            self.state = before
        return ok

    def rollback(self, num_tokens: int) -> None:
        inner = 0
        for _ in range(num_tokens):
            state, took = self._history.pop()
            self.state = state
            inner += took
        if inner:
            self.inner.rollback(inner)

    def is_terminated(self) -> bool:
        return self.state == _ANSWER and self.inner.is_terminated()

    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        if self.state == _THINKING:
            mask[idx].fill_(-1)
            return
        self.inner.fill_vocab_mask(mask, idx)
        if self.state == _UNDECIDED:  # thinking may still begin
            word, bit = divmod(self.think.start, 32)
            value = int(mask[idx, word]) | (1 << bit)
            mask[idx, word] = value - (1 << 32) if value >= 1 << 31 else value

    def copy(self) -> ReasonerGrammarObject:
        out = ReasonerGrammarObject(self.inner.copy(), self.think, self.state)
        out._history = list(self._history)
        return out
