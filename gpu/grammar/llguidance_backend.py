"""The ``llguidance`` grammar backend: an Earley parser over a lazy lexer, so building a
matcher is cheap and masks are computed as decoding goes (GIL released). A step's
masks fill, and its tokens are accepted, in one ``LLExecutor`` call each.

Every constraint becomes an llguidance grammar text (JSON schema, regex, GBNF-style
EBNF converted to Lark, structural tags as lazy triggers), checked by building its
matcher: an error there is the client's 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, cast

import torch

from .base import BaseGrammarBackend, BaseGrammarObject, GrammarContext, GrammarError
from .tags import legacy_structural_tag

__all__ = ["GuidanceBackend", "GuidanceGrammar"]


def _first_line(text: str) -> str:
    # llguidance appends its parser state and the grammar to an error: keep the cause.
    return text.strip().split("\n", 1)[0]


_ANGLED = re.compile(r"(<[^<>\s]+>)")  # what an added token such as <tool_call> looks like
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` where it leaves them open: the
    output has the properties the schema names, as xgrammar's strict mode does (else a
    model may add keys without end). Left alone under ``allOf``, where each branch
    names only some of the properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s) for name, s in out[key].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "allOf" not in schema and not any(k in schema for k in _OPEN):
        out["additionalProperties"] = False
    return out


class GuidanceGrammar(BaseGrammarObject):
    def __init__(self, matcher: object, executor: Any) -> None:
        self.matcher = matcher
        self.executor = executor  # the backend's llguidance.LLExecutor

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token))  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)  # type: ignore[attr-defined]

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())  # type: ignore[attr-defined]

    def fill_vocab_mask(self, mask: torch.Tensor, idx: int) -> None:
        # Straight into the row (llguidance.torch would import torch.compile machinery).
        row = mask[idx]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())  # type: ignore[attr-defined]

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.matcher.deep_copy(), self.executor)  # type: ignore[attr-defined]

    @classmethod
    def fill_vocab_masks(
        cls, grammars: Sequence[BaseGrammarObject], mask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        mine = cast("Sequence[GuidanceGrammar]", grammars)
        if not mask.is_contiguous():
            raise ValueError("the mask rows must be one contiguous block")
        pairs = [(g.matcher, row) for g, row in zip(mine, rows, strict=True)]
        row_bytes = mask.shape[1] * mask.element_size()
        mine[0].executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), row_bytes, mask.shape[0])

    @classmethod
    def accept_tokens(
        cls, grammars: Sequence[BaseGrammarObject], tokens: Sequence[int]
    ) -> list[bool]:
        mine = cast("Sequence[GuidanceGrammar]", grammars)
        pairs = [(g.matcher, t) for g, t in zip(mine, tokens, strict=True)]
        return [bool(ok) for ok in mine[0].executor.consume_token_par(pairs)]


class GuidanceBackend(BaseGrammarBackend):
    name = "llguidance"

    def __init__(self, ctx: GrammarContext) -> None:
        super().__init__(ctx)
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(
            ctx.tokenizer, n_vocab=ctx.vocab_size, eos_token=list(ctx.eos_token_ids)
        )
        # One thread: the mask thread runs beside the forward pass, which has the cores.
        self._executor = llguidance.LLExecutor(num_threads=1)

    def _grammar(self, grammar: str) -> GuidanceGrammar:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return GuidanceGrammar(matcher, self._executor)

    def _json_options(self, schema: Any) -> Any:
        """``schema`` made strict, with the whitespace rule in its ``x-guidance``: compact
        JSON spaced as xgrammar's and ``json.dumps``'s (``", "``, ``": "``), where
        llguidance's own compact form has no spaces."""
        strict = _strict(schema)
        if isinstance(strict, dict):
            spacing = (
                {} if self.ctx.any_whitespace else {"item_separator": ", ", "key_separator": ": "}
            )
            options = {
                "whitespace_flexible": self.ctx.any_whitespace,
                **spacing,
                **strict.get("x-guidance", {}),
            }
            strict = {**strict, "x-guidance": options}
        return strict

    def dispatch_json(self, schema: str) -> GuidanceGrammar:
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                self._json_options(json.loads(schema))
            )
        except ValueError as exc:
            raise GrammarError(f"not valid JSON: {_first_line(str(exc))}") from None
        return self._grammar(grammar)

    def dispatch_regex(self, regex: str) -> GuidanceGrammar:
        return self._grammar(self._llg.LLMatcher.grammar_from_regex(regex))

    def dispatch_ebnf(self, ebnf: str) -> GuidanceGrammar:
        try:
            grammar = self._llg.grammar_from("ebnf", ebnf)
        except ValueError as exc:
            raise GrammarError(_first_line(str(exc))) from None
        return self._grammar(grammar)

    def dispatch_structural_tag(self, tag: str) -> GuidanceGrammar:
        legacy = legacy_structural_tag(tag)
        if legacy is None:
            raise GrammarError("llguidance reads structural tags only as {structures, triggers}")
        structures, triggers = legacy
        # Free text (lazily matched) until a trigger, then begin, the JSON, end. A trigger
        # or end that is one of the tokenizer's added tokens (Qwen's <tool_call>) must be
        # written as that token: llguidance never matches added tokens as text.
        rules = [f"start: ({' | '.join(f'tag_{i}' for i in range(len(structures)))})* TEXT"]
        rules.append("TEXT: /(.|\\n)*/")
        for i, s in enumerate(structures):
            trigger = next(t for t in triggers if s["begin"].startswith(t))
            schema = json.dumps(self._json_options(s["schema"]))
            body = f"{self._lark_text(s['begin'][len(trigger) :])} %json {schema} {self._lark_text(s['end'])}"
            if self._is_special(trigger):
                rules.append(f"tag_{i}: TEXT {trigger} {body}")
            else:
                rules.append(f"tag_{i}_trigger[lazy]: TEXT {json.dumps(trigger)}")
                rules.append(f"tag_{i}: tag_{i}_trigger {body}")
        return self._grammar(self._llg.LLMatcher.grammar_from_lark("\n".join(rules)))

    def _lark_text(self, text: str) -> str:
        """``text`` as a Lark sequence: added tokens bare, the rest as string literals."""
        parts = [p for p in _ANGLED.split(text) if p]
        return " ".join(p if self._is_special(p) else json.dumps(p) for p in parts)

    def _is_special(self, text: str) -> bool:
        if not _ANGLED.fullmatch(text):
            return False
        ids = self.tokenizer.tokenize_str(text)
        return len(ids) == 1 and bool(self.tokenizer.is_special_token(ids[0]))
