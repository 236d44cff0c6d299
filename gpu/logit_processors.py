"""Logit processors: named, parameterized per-request logit edits (never code from requests).

A request lists processors by name in ``SamplingParams.logit_processors``; the
worker builds one instance per sequence (so an instance may keep incremental
state) and calls it on that sequence's logits row every sampled step, after
penalties and bias and before the vocabulary mask, temperature and top-k/p.

A plugin adds one with::

    from actorlm.extensions.points import LOGIT_PROCESSORS
    LOGIT_PROCESSORS.register("my_proc", MyProcessor)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from ..extensions.points import LOGIT_PROCESSORS
from ..messages.sampling import LogitProcessorSpec

__all__ = ["BanTokens", "LogitProcessor", "NoRepeatNgram", "build_processors"]


class LogitProcessor(ABC):
    """One sequence's processor.

    ``__init__`` validates ``params`` and raises ``ValueError`` with a clear message.
    Processors are built once, in the worker where they run: a ``ValueError`` from
    ``__init__`` or ``check_vocab`` ends that request alone with a 400.
    """

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if the parameters name tokens outside the vocabulary."""
        return None

    @abstractmethod
    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` (one row, ``[V]`` float32) given the sequence so far
        (prompt then outputs); may work in place; returns the row to use."""


def _only_keys(name: str, params: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(
            f"logit processor {name!r}: unknown parameter(s) {unknown}; allowed: {sorted(allowed)}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class BanTokens(LogitProcessor):
    """``{"token_ids": [int, ...]}``: these tokens are never sampled."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        _only_keys("ban_tokens", params, {"token_ids"})
        ids = params.get("token_ids")
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(
                "logit processor 'ban_tokens': token_ids must be a list of non-negative ints"
            )
        self.token_ids: list[int] = sorted(set(ids))
        self._ids: torch.Tensor | None = None  # built once on the logits' device

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.token_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"logit processor 'ban_tokens': token ids {bad[:8]} are outside the "
                f"vocabulary (size {vocab_size})"
            )

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.token_ids:
            return logits
        if self._ids is None or self._ids.device != logits.device:
            self._ids = torch.tensor(self.token_ids, dtype=torch.long, device=logits.device)
        logits[self._ids] = float("-inf")
        return logits


class NoRepeatNgram(LogitProcessor):
    """``{"ngram_size": n}``: ban any token that would complete an n-gram already
    present in prompt + output (HF ``no_repeat_ngram_size`` semantics)."""

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        _only_keys("no_repeat_ngram", params, {"ngram_size"})
        n = params.get("ngram_size")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("logit processor 'no_repeat_ngram': ngram_size must be an int >= 1")
        self.n: int = n
        # (n-1)-gram → tokens that followed it. Built incrementally, since the sequence
        # only grows between calls: each step costs O(1) instead of a rescan.
        self._followers: dict[tuple[int, ...], set[int]] = {}
        self._next_start = 0  # first n-gram start not indexed yet

    def _index(self, token_ids: Sequence[int]) -> None:
        n = self.n
        if len(token_ids) < self._next_start + n - 1:  # sequence shrank: start over
            self._followers.clear()
            self._next_start = 0
        for i in range(self._next_start, len(token_ids) - n + 1):
            key = tuple(token_ids[i : i + n - 1])
            self._followers.setdefault(key, set()).add(token_ids[i + n - 1])
        self._next_start = max(self._next_start, len(token_ids) - n + 1)

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(token_ids) < self.n - 1:
            return logits
        self._index(token_ids)
        key = tuple(token_ids[len(token_ids) - self.n + 1 :]) if self.n > 1 else ()
        banned = self._followers.get(key)
        if banned:
            idx = torch.tensor(sorted(banned), dtype=torch.long, device=logits.device)
            logits[idx] = float("-inf")
        return logits


def build_processors(specs: Sequence[LogitProcessorSpec], vocab_size: int) -> list[LogitProcessor]:
    """Instantiate a request's processors; ``ValueError`` names the bad one (or the
    known names, for an unknown one)."""
    out: list[LogitProcessor] = []
    for spec in specs:
        if spec.name not in LOGIT_PROCESSORS:
            known = ", ".join(LOGIT_PROCESSORS.names()) or "none"
            raise ValueError(f"unknown logit processor {spec.name!r}; known: {known}")
        proc = LOGIT_PROCESSORS.get(spec.name)(dict(spec.params))
        proc.check_vocab(vocab_size)
        out.append(proc)
    return out


# Registered only if absent: a plugin's register() runs before this module is first
# imported, and its override of a built-in name must win.
for _name, _cls, _help in (
    ("ban_tokens", BanTokens, "never sample the given token_ids"),
    ("no_repeat_ngram", NoRepeatNgram, "ban tokens that would repeat an n-gram (ngram_size)"),
):
    if _name not in LOGIT_PROCESSORS:
        LOGIT_PROCESSORS.register(_name, _cls, help=_help, source="builtin")
