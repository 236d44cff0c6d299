"""actorlm: an LLM serving engine built as an asyncio actor system."""

from __future__ import annotations

from typing import Any

from .extensions.moved import install as _install_moved
from .messages.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "__version__"]

__version__ = "0.1.0"

_install_moved()  # old module paths keep working (extensions/moved.py)


def __getattr__(name: str) -> Any:
    # Heavy parts (torch, zmq) load only when used.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
