"""A grammar backend, chosen by flag: ``--grammar-backend example_recording_grammar``.

It is xgrammar's backend, recording each constraint it compiles. A backend of your own
subclasses ``BaseGrammarBackend`` and returns ``BaseGrammarObject``s from its
``dispatch_json``, ``dispatch_regex``, ``dispatch_ebnf`` (and, if it can,
``dispatch_structural_tag``); a ``GrammarError`` it raises is the client's 400.
"""

from __future__ import annotations

from actorlm.gpu.grammar import BaseGrammarObject
from actorlm.gpu.grammar.xgrammar_backend import XGrammarGrammarBackend

from .record import record

__all__ = ["RecordingGrammarBackend"]


class RecordingGrammarBackend(XGrammarGrammarBackend):
    name = "example_recording_grammar"

    def dispatch(self, kind: str, value: str) -> BaseGrammarObject:
        record(f"grammar.{kind}")
        return super().dispatch(kind, value)
