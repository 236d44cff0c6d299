"""Structural tags in SGLang's (and OpenAI-style) form, read once for every backend::

    {"type": "structural_tag",
     "structures": [{"begin": "<tool_call>{\\"name\\": \\"f\\", \\"arguments\\": ",
                     "schema": {...}, "end": "}</tool_call>"}],
     "triggers": ["<tool_call>"]}

Text is free until a trigger appears; from there the structure whose ``begin`` it
starts must follow: ``begin``, JSON valid for ``schema``, then ``end``.
"""

from __future__ import annotations

import json
from typing import Any

from .base import GrammarError

__all__ = ["legacy_structural_tag"]


def legacy_structural_tag(tag: str) -> tuple[list[dict[str, Any]], list[str]] | None:
    """``(structures, triggers)`` of a tag in the form above; None for another form (a
    backend may know its own); GrammarError for a malformed one."""
    try:
        obj = json.loads(tag)
    except ValueError as exc:
        raise GrammarError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or "structures" not in obj:
        return None
    structures: Any = obj.get("structures")
    triggers: Any = obj.get("triggers")
    ok = (
        isinstance(structures, list)
        and structures
        and all(
            isinstance(s, dict)
            and isinstance(s.get("begin"), str)
            and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), (dict, bool))
            for s in structures
        )
        and isinstance(triggers, list)
        and triggers
        and all(isinstance(t, str) and t for t in triggers)
    )
    if not ok:
        raise GrammarError(
            "structural_tag needs 'structures' (a list of {begin, schema, end}) and "
            "'triggers' (a list of non-empty strings)"
        )
    for s in structures:
        if not any(s["begin"].startswith(t) for t in triggers):
            raise GrammarError(f"structural_tag: begin {s['begin']!r} starts with no trigger")
    return structures, triggers
