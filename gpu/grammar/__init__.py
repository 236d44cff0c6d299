"""Structured output: grammar backends (xgrammar, llguidance, plugins') and the
worker's grammar manager. See ``base`` for the interface and ``manager`` for where
compilation runs and how masks meet the forward pass."""

from __future__ import annotations

from ...extensions.points import GRAMMAR_BACKENDS
from .base import BaseGrammarBackend, BaseGrammarObject, GrammarContext, GrammarError

__all__ = ["BaseGrammarBackend", "BaseGrammarObject", "GrammarContext", "GrammarError"]

# By dotted path: a process that never compiles a constraint never imports the library.
GRAMMAR_BACKENDS.register_builtin(
    "xgrammar",
    "actorlm.gpu.grammar.xgrammar_backend:XGrammarGrammarBackend",
    help="xgrammar: compiled pushdown automata with cached token masks (the default)",
)
GRAMMAR_BACKENDS.register_builtin(
    "llguidance",
    "actorlm.gpu.grammar.llguidance_backend:GuidanceBackend",
    help="llguidance: an Earley parser over a lazy lexer; masks computed as it goes",
)
