"""The ``xgrammar`` grammar backend (the default): a pushdown automaton with a
precomputed token-mask cache, compiled per constraint.

xgrammar's compiler runs in C++ with the GIL released, so compiles in the manager's
threads run beside the forward pass. Its own compile cache is off: the manager caches
compiled constraints (bounded, one place to look). A step's masks fill, and its tokens
are accepted, in one batch call each (``BatchGrammarMatcher``): 32 rows took ~0.13 ms
one at a time, mostly Python, against ~0.05 ms batched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, cast

import torch

from .base import BaseGrammarBackend, BaseGrammarObject, GrammarContext, GrammarError
from .schema_support import check_schema, check_tag_schemas
from .tags import legacy_structural_tag

__all__ = ["XGrammarGrammar", "XGrammarGrammarBackend"]

# "[20:47:31] /project/cpp/json_schema_converter.cc:5082: Unsupported type" → the message.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def _message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip()).split("\n", 1)[0]


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, matcher: object, keep: torch.Tensor | None, batch: Any) -> None:
        self.matcher = matcher
        self.keep = keep  # a bitmask ANDed into every mask (see _json_tokens)
        self.batch = batch  # the backend's xgrammar.BatchGrammarMatcher

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)  # type: ignore[attr-defined]

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())  # type: ignore[attr-defined]

    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, idx)  # type: ignore[attr-defined]
        if self.keep is not None:
            mask[idx] &= self.keep

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.matcher.fork(), self.keep, self.batch)  # type: ignore[attr-defined]

    @classmethod
    def fill_vocab_masks(
        cls, grammars: Sequence[BaseGrammarObject], mask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        mine = cast("Sequence[XGrammarGrammar]", grammars)
        mine[0].batch.batch_fill_next_token_bitmask([g.matcher for g in mine], mask, list(rows))
        # The keep masks in numpy: one thread. A torch op over the batch's rows would
        # start a thread team of its own beside the forward's, on the same cores.
        words = mask.numpy()
        keeps: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for g, row in zip(mine, rows, strict=True):
            if g.keep is not None:
                keeps.setdefault(id(g.keep), (g.keep, []))[1].append(row)
        for keep, keep_rows in keeps.values():
            words[keep_rows] &= keep.numpy()

    @classmethod
    def accept_tokens(
        cls, grammars: Sequence[BaseGrammarObject], tokens: Sequence[int]
    ) -> list[bool]:
        mine = cast("Sequence[XGrammarGrammar]", grammars)
        return mine[0].batch.batch_accept_token([g.matcher for g in mine], list(tokens))  # type: ignore[no-any-return]


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
        # One thread: the mask thread runs beside the forward pass, which has the cores.
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._json_keep = self._json_tokens(info.decoded_vocab)

    def _json_tokens(self, vocab: list[bytes]) -> torch.Tensor:
        """The tokens JSON may use: none with a raw control byte (JSON escapes them in
        strings; compact JSON has no whitespace between tokens, flexible JSON only
        tab, newline and return). The length-bounded strings of xgrammar 0.2 exclude only
        quote, backslash, CR and LF, which lets a model write JSON no parser reads."""
        spacing = {9, 10, 13} if self.ctx.any_whitespace else set()
        bits = torch.zeros(self.ctx.bitmask_words * 32, dtype=torch.bool)
        for token, text in enumerate(vocab[: self.ctx.vocab_size]):
            bits[token] = all(b >= 0x20 or b in spacing for b in text)
        bits[list(self.ctx.eos_token_ids)] = True
        weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
        words = (bits.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def _grammar(
        self,
        compile_fn: object,
        *args: object,
        keep: torch.Tensor | None = None,
        **kwargs: object,
    ) -> XGrammarGrammar:
        try:
            compiled = compile_fn(*args, **kwargs)  # type: ignore[operator]
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
            raise GrammarError(_message(exc)) from None
        return XGrammarGrammar(self._xgr.GrammarMatcher(compiled), keep, self._batch)

    def dispatch_json(self, schema: str) -> XGrammarGrammar:
        try:
            parsed = json.loads(schema)
        except ValueError:
            parsed = None  # not JSON: xgrammar's error says where
        check_schema(parsed)  # a keyword xgrammar would ignore: the fallback's, or a 400
        return self._grammar(
            self.compiler.compile_json_schema,
            schema,
            keep=self._json_keep,
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
            check_tag_schemas(json.loads(tag))
            return self._grammar(self.compiler.compile_structural_tag, tag)
        structures, triggers = legacy
        for i, s in enumerate(structures):  # tool calls' parameters come this way
            check_schema(s["schema"], f"#/structures/{i}/schema")
        # The legacy form's own conversion lets JSON take any whitespace, which a small
        # model pads without end: the same rule as dispatch_json instead.
        spacing = {} if self.ctx.any_whitespace else {"max_whitespace_cnt": 1}
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s["schema"], **spacing},
                "end": s["end"],
            }
            for s in structures
        ]
        fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
        tag_json = json.dumps({"type": "structural_tag", "format": fmt})
        return self._grammar(self.compiler.compile_structural_tag, tag_json)
