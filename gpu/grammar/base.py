"""The grammar backend interface: the seeds' ``BaseGrammarBackend`` and grammar object.

A backend compiles one constraint (a JSON schema, a regex, an EBNF grammar, a
structural tag) into a :class:`BaseGrammarObject`, the per-request matcher: it fills
its row of a packed vocabulary bitmask (int32 words, bit ``j`` of word ``w`` allows
token ``32 * w + j``, xgrammar's layout, which ``actorlm.gpu.sampling`` applies),
accepts the sampled token, rolls back, reports termination, and can be copied. The
manager keeps one compiled object per constraint and gives every request a copy.

A plugin adds a backend with::

    from actorlm.extensions.points import GRAMMAR_BACKENDS
    GRAMMAR_BACKENDS.register("my_backend", "my_pkg.grammar:MyBackend")

and ``--grammar-backend my_backend`` selects it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["BaseGrammarBackend", "BaseGrammarObject", "GrammarContext", "GrammarError"]


class GrammarError(ValueError):
    """A constraint this backend cannot compile (invalid, or a feature it lacks). The
    message is for the client: it ends that request with a 400."""


@dataclass(frozen=True)
class GrammarContext:
    """What a backend is built from, once per worker."""

    tokenizer: Any  # the model's HF tokenizer (a fast one)
    vocab_size: int  # the model's vocabulary (may be padded past the tokenizer's)
    eos_token_ids: tuple[int, ...]  # what a finished grammar allows next
    any_whitespace: bool = False  # JSON: any whitespace between tokens, else compact
    threads: int = 1  # threads one compile may use

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32


class BaseGrammarObject(ABC):
    """One request's matcher over a compiled constraint."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False when the constraint does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Nothing but a stop token can follow (or one was accepted)."""

    @abstractmethod
    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        """Write the allowed next tokens into row ``idx`` of ``mask`` (int32 ``[N, W]``)."""

    @abstractmethod
    def copy(self) -> BaseGrammarObject:
        """An independent matcher in the same state (sharing the compiled constraint)."""

    # A step's matchers of one class go through these together: a backend with batch
    # calls overrides them (one native call for the batch instead of a Python round
    # per request); the results are those of the one-at-a-time methods.
    @classmethod
    def fill_vocab_masks(
        cls, grammars: Sequence[BaseGrammarObject], mask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """``grammars[k].fill_vocab_mask(mask, rows[k])`` for every k."""
        for grammar, row in zip(grammars, rows, strict=True):
            grammar.fill_vocab_mask(mask, row)

    @classmethod
    def accept_tokens(
        cls, grammars: Sequence[BaseGrammarObject], tokens: Sequence[int]
    ) -> list[bool]:
        """``grammars[k].accept_token(tokens[k])`` for every k."""
        return [g.accept_token(t) for g, t in zip(grammars, tokens, strict=True)]

    @property
    def constrains_next(self) -> bool:
        """False when the next token is free (a reasoner still thinking): no mask row."""
        return True


class BaseGrammarBackend(ABC):
    """Compiles constraints into grammar objects. Built once per worker from a
    :class:`GrammarContext`; ``dispatch`` may run in several threads at once."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: GrammarContext) -> None:
        self.ctx = ctx

    def dispatch(self, kind: str, value: str) -> BaseGrammarObject:
        """Compile ``value`` of ``kind`` (``messages.sampling.CONSTRAINT_KINDS``);
        raises :class:`GrammarError` saying what is wrong with it."""
        handler = {
            "json_schema": self.dispatch_json,
            "regex": self.dispatch_regex,
            "ebnf": self.dispatch_ebnf,
            "structural_tag": self.dispatch_structural_tag,
        }.get(kind)
        if handler is None:
            raise GrammarError(f"unknown constraint kind {kind!r}")
        return handler(value)

    @abstractmethod
    def dispatch_json(self, schema: str) -> BaseGrammarObject: ...

    @abstractmethod
    def dispatch_regex(self, regex: str) -> BaseGrammarObject: ...

    @abstractmethod
    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject: ...

    def dispatch_structural_tag(self, tag: str) -> BaseGrammarObject:
        raise GrammarError(f"the {self.name} grammar backend does not support structural tags")
