"""The tokenizer role: the actor shell (`actor`), tokenizers and chat templates
(`tokenization`), incremental detokenization and stop strings (`detokenize`)."""

from __future__ import annotations

from typing import Any

__all__ = ["TokenizerActor"]


def __getattr__(name: str) -> Any:
    # Lazily, so the pure cores beside the actor import without the actor runtime.
    if name == "TokenizerActor":
        from .actor import TokenizerActor

        return TokenizerActor
    raise AttributeError(name)
