"""What every actor process does before its actor starts: logging, plugins, event loop."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ...config import EngineConfig

__all__ = ["PluginLoadError", "event_loop_runner", "prepare_process", "setup_logging"]

T = TypeVar("T")


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
    )


class PluginLoadError(ValueError):
    """A plugin failed to load where the engine is to run: it does not start half-working."""


def prepare_process(config: EngineConfig, role: str) -> None:
    """Logging, then plugins (``register()`` runs once in every actor process, with its
    settings); any plugin that failed to load stops the start."""
    from ..replicas import base_role

    setup_logging(config.log_level)
    if base_role(role) != "worker":
        # Only the worker computes; elsewhere torch (if imported) and HF tokenizers
        # must not spin threads that steal cores from the forward pass.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    from ...extensions.plugins import load_plugins

    report = load_plugins(settings=config.plugins)
    if report.errors:
        raise PluginLoadError("; ".join(report.errors))


def event_loop_runner() -> Callable[[Coroutine[Any, Any, T]], T]:
    """``asyncio.run`` on uvloop where installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.run
    return uvloop.run
