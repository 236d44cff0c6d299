"""The ``xgrammar`` grammar backend (the default): a pushdown automaton with a
precomputed token-mask cache, compiled per constraint.

xgrammar's compiler runs in C++ with the GIL released, so compiles in the manager's
threads run beside the forward pass. Its own compile cache is off: the manager caches
compiled constraints (bounded, one place to look).
"""

from __future__ import annotations

import json
import re
import warnings

import torch

from .base import BaseGrammarBackend, BaseGrammarObject, GrammarContext, GrammarError
from .tags import legacy_structural_tag

__all__ = ["XGrammarGrammar", "XGrammarGrammarBackend"]

# "[20:47:31] /project/cpp/json_schema_converter.cc:5082: Unsupported type" → the message.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def _message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip()).split("\n", 1)[0]


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, matcher: object) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)  # type: ignore[attr-defined]

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())  # type: ignore[attr-defined]

    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, idx)  # type: ignore[attr-defined]

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.matcher.fork())  # type: ignore[attr-defined]


class XGrammarGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"

    def __init__(self, ctx: GrammarContext) -> None:
        super().__init__(ctx)
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            ctx.tokenizer, vocab_size=ctx.vocab_size, stop_token_ids=list(ctx.eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=ctx.threads, cache_enabled=False)

    def _grammar(self, compile_fn: object, *args: object, **kwargs: object) -> XGrammarGrammar:
        try:
            compiled = compile_fn(*args, **kwargs)  # type: ignore[operator]
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
            raise GrammarError(_message(exc)) from None
        return XGrammarGrammar(self._xgr.GrammarMatcher(compiled))

    def dispatch_json(self, schema: str) -> XGrammarGrammar:
        return self._grammar(
            self.compiler.compile_json_schema,
            schema,
            any_whitespace=self.ctx.any_whitespace,
            strict_mode=True,
        )

    def dispatch_regex(self, regex: str) -> XGrammarGrammar:
        return self._grammar(self.compiler.compile_regex, regex)

    def dispatch_ebnf(self, ebnf: str) -> XGrammarGrammar:
        return self._grammar(self.compiler.compile_grammar, ebnf)

    def dispatch_structural_tag(self, tag: str) -> XGrammarGrammar:
        legacy = legacy_structural_tag(tag)
        if legacy is None:  # xgrammar's own format: {"type": "structural_tag", "format": ...}
            return self._grammar(self.compiler.compile_structural_tag, tag)
        structures, triggers = legacy
        items = [
            self._xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
            )
            for s in structures
        ]
        with warnings.catch_warnings():  # the (tags, triggers) form is deprecated, not gone
            warnings.simplefilter("ignore", DeprecationWarning)
            return self._grammar(self.compiler.compile_structural_tag, items, triggers)
