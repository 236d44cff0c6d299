"""Module paths that moved, kept importable under their old names.

Plugins import from, and hook targets in, the paths ``docs/plugins.md`` names.
When a module moves, its old dotted path stays an alias of the new module (the
very same module object, so a hook on ``old.path.func`` patches what the engine
calls) until ``API_VERSION`` drops it. The root package installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["MOVED_MODULES", "current_path", "install"]

# old module path → new module path (the re-foldering of 2026-12)
MOVED_MODULES: dict[str, str] = {
    **{
        f"actorlm.actors.{name}": f"actorlm.actors.runtime.{name}"
        for name in ("actor", "calls", "transport", "supervisor", "child", "process", "harness")
    },
    "actorlm.actors.tokenization": "actorlm.actors.tokenizer.tokenization",
    "actorlm.actors.detokenize": "actorlm.actors.tokenizer.detokenize",
    "actorlm.actors.policy": "actorlm.actors.scheduler.policy",
    "actorlm.actors.cache_manager": "actorlm.actors.cache.actor",
    **{
        f"actorlm.actors.{name}": f"actorlm.actors.cache.{name}"
        for name in ("kv_cache", "radix", "allocator", "eviction", "hicache")
    },
    **{
        f"actorlm.actors.{name}": f"actorlm.{name}"
        for name in ("cli", "engine", "launch", "schema", "report")
    },
    "actorlm.gateway.server": "actorlm.serve",
    **{f"actorlm.gpu.{name}": f"actorlm.gpu.kernels.{name}" for name in ("native", "ops", "qgemm")},
}


def current_path(dotted: str) -> str:
    """``dotted`` (a module, or a name in one) under its module's current path: a hook
    target named by the old path and one named by the new are then one target."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        new = MOVED_MODULES.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return dotted


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
