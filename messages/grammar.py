"""scheduler ⇄ worker: compiling a request's output constraint before it is admitted.

A constrained request waits in the scheduler, holding no batch slot and no KV page,
while the worker compiles its constraint off every event loop; the reply says which
backend will serve it, or why it cannot be served (an invalid schema, a compile past
``--grammar-compile-timeout``), which ends that request alone.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Message
from .errors import ErrorCode

__all__ = ["CompileGrammar", "GrammarCompiled"]


class CompileGrammar(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "grammar.compile"
    rid: str
    kind: str  # one of messages.sampling.CONSTRAINT_KINDS
    value: str


class GrammarCompiled(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "grammar.compiled"
    rid: str
    backend: str = ""  # the backend that compiled it ("" when it failed)
    error: str = ""  # why it cannot be served ("" when it compiled)
    code: ErrorCode = ErrorCode.INVALID_REQUEST
    compile_ms: float = 0.0  # waited in the worker (about 0 for a cached constraint)
    cached: bool = False
