"""``actorlm plugins``: what is installed and active, with where each piece came from."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["print_hook_surface", "print_plugins"]


def print_hook_surface(out: TextIO) -> int:
    """The declared hook targets: where each runs, its signature, what it does."""
    from .extensions.surface import API_VERSION, HOOK_TARGETS, signature_of

    print(f"Declared hook targets (plugin API {API_VERSION}):", file=out)
    for t in HOOK_TARGETS:
        print(f"  {t.target}{signature_of(t.target)}", file=out)
        print(f"      runs in: {t.process}; {t.summary}", file=out)
    return 0


def print_plugins(out: TextIO, settings: dict[str, dict[str, Any]] | None = None) -> int:
    """Print the report; the exit status (1 when the platform could not be chosen or a
    plugin failed). ``settings``: each plugin's ``--plugin-config``."""
    from .extensions.hooks import HookRegistry
    from .extensions.interceptors import interceptors
    from .extensions.plugins import PlatformError, PluginAPIError, current_platform, load_plugins
    from .extensions.points import load_builtins
    from .extensions.registry import all_registries

    try:
        report = load_plugins(settings=settings)
    except PlatformError as exc:
        report = exc.report
    except PluginAPIError as exc:
        print(f"actorlm: error: {exc}", file=sys.stderr)
        return 2
    load_builtins()
    for title, infos in (
        ("Plugins (entry points actorlm.plugins):", report.plugins),
        ("Platform plugins (entry points actorlm.platforms):", report.platforms),
    ):
        print(title, file=out)
        for p in infos:
            err = f"  error: {p.error}" if p.error else ""
            print(f"  {p.name:<24} {p.status:<12} dist={p.dist or '?'}  {p.value}{err}", file=out)
            if report.settings.get(p.name):
                print(f"  {'':<24} settings: {report.settings[p.name]}", file=out)
        if not infos:
            print("  (none)", file=out)
    active = report.platform or f"none ({report.platform_error})"
    print(f"Active platform: {active}", file=out)
    if report.platform:
        for key, value in current_platform().describe().items():
            print(f"  {key}: {value}", file=out)
    print("Registries:", file=out)
    for reg in sorted(all_registries().values(), key=lambda r: r.kind):
        flag = f" ({reg.flag})" if reg.flag else ""
        unused = f" not used yet: {reg.unused}" if reg.unused else ""
        print(f"  {reg.kind}{flag}:{unused}", file=out)
        for entry in reg:
            print(f"    {entry.name:<28} [{entry.source}]", file=out)
        if reg.kind == "model architecture":
            fallback = "[transformers fallback: --model-impl auto|transformers]"
            print(f"    {'(any other decoder)':<28} {fallback}", file=out)
    print("Hooks:", file=out)
    hooks = HookRegistry.hooks()
    for h in hooks:
        print(f"  {h.type:<8} {h.target}  fn={h.fn}  [{h.source}] {h.status}", file=out)
    if not hooks:
        print("  (none)", file=out)
    print("Message interceptors:", file=out)
    chain = interceptors()
    for i in chain:
        typ = i.msg_type.__name__ if i.msg_type else "*"
        print(f"  {i.role}:{typ}:{i.direction}  fn={i.name}  [{i.source}]", file=out)
    if not chain:
        print("  (none)", file=out)
    for err in report.errors:
        print(f"error: {err}", file=out)
    if report.platform_error:
        print(f"actorlm: error: {report.platform_error}", file=sys.stderr)
    return 1 if report.platform_error or report.errors else 0
