"""Plugin discovery: entry points, ``ACTORLM_PLUGINS`` and ``ACTORLM_PLATFORM``.

``load_plugins()`` runs once per process, before the actor starts:

1. Read the two environment variables (here and nowhere else).
2. Choose the platform from the ``actorlm.platforms`` entry points:
   ``ACTORLM_PLATFORM`` set: only that entry point is loaded, allowlist or not
   (``cpu``/``cuda`` name the built-ins); an unknown name or an ``activate()``
   returning None is an error. Unset: every platform plugin the
   allowlist admits is activated; none → the built-in ``cuda`` if
   ``torch.cuda.is_available()`` else ``cpu``; one → it; several → an error
   naming them. The chosen class path is registered in ``PLATFORMS`` under the
   entry point's name.
3. Run, in entry-point name order, each ``actorlm.plugins`` entry point's ``register()`` the
   allowlist (entry-point names; unset: all, empty: none) admits, with ``current_source`` set
   to its name, skipping (without importing) those shipped by the distribution of a platform
   that was not chosen. A ``register`` that takes a parameter gets the plugin's
   ``PluginSettings`` (``--plugin-config NAME.KEY=VALUE``, ``[plugins.NAME]``).
4. ``HookRegistry.apply_hooks()``.

A plugin whose entry point's module says ``REQUIRES_API = N`` (or a collection of
versions) and does not accept this engine's ``API_VERSION`` stops the start-up with a
``PluginAPIError`` naming it: a plugin written against another surface must not run
half-working.

A plugin that fails to import, activate or register is logged and recorded in
the ``PluginReport`` with its name and distribution; the others still load.
A platform that cannot be chosen raises ``PlatformError`` (carrying the
report) once everything else is loaded, so ``actorlm plugins`` can still show
all of it; the failure is remembered, and later calls raise it again.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from .hooks import HookRegistry
from .points import PLATFORMS
from .registry import current_source
from .settings import PluginSettings
from .surface import API_VERSION

__all__ = [
    "PLATFORM_GROUP",
    "PLUGIN_GROUP",
    "PlatformError",
    "PluginAPIError",
    "PluginInfo",
    "PluginReport",
    "current_platform",
    "load_plugins",
    "plugin_report",
    "reset_plugins",
]

log = logging.getLogger(__name__)

PLUGIN_GROUP = "actorlm.plugins"
PLATFORM_GROUP = "actorlm.platforms"
BUILTIN_PLATFORMS = {
    "cpu": "actorlm.gpu.platforms:CpuPlatform",
    "cuda": "actorlm.gpu.platforms:CudaPlatform",
}

# Built-ins by path, before any plugin runs, so a plugin may override a name.
for _name, _path in BUILTIN_PLATFORMS.items():
    if _name not in PLATFORMS:
        PLATFORMS.register(_name, _path, source="builtin", help=f"built-in {_name} platform")


class PluginAPIError(ValueError):
    """A plugin written for another version of the plugin surface."""


class PlatformError(RuntimeError):
    def __init__(self, message: str, report: PluginReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class PluginInfo:
    name: str
    group: str
    value: str  # "module:attr"
    dist: str  # distribution name, "" if unknown
    # general: loaded | failed | not allowed | skipped
    # platform: active | inactive | failed | not allowed | not selected
    status: str = "discovered"
    error: str = ""


@dataclass
class PluginReport:
    plugins: list[PluginInfo] = field(default_factory=list)
    platforms: list[PluginInfo] = field(default_factory=list)
    platform: str = ""  # the active platform's name in PLATFORMS; "" if none could be chosen
    allowlist: tuple[str, ...] | None = None  # None: every plugin allowed
    errors: list[str] = field(default_factory=list)
    platform_error: str = ""
    api_errors: list[str] = field(default_factory=list)  # REQUIRES_API mismatches: fatal
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # per plugin


@dataclass(frozen=True)
class _Settings:
    allowlist: frozenset[str] | None
    platform: str | None
    plugins: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], plugins: Mapping[str, Mapping[str, Any]] | None = None
    ) -> _Settings:
        raw = environ.get("ACTORLM_PLUGINS")
        allowlist = None
        if raw is not None:
            allowlist = frozenset(n.strip() for n in raw.split(",") if n.strip())
        platform = environ.get("ACTORLM_PLATFORM", "").strip() or None
        return cls(allowlist, platform, dict(plugins or {}))

    def allows(self, name: str) -> bool:
        return self.allowlist is None or name in self.allowlist


_lock = threading.RLock()
_report: PluginReport | None = None


def load_plugins(
    environ: Mapping[str, str] | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> PluginReport:
    """Discover and load plugins once per process (``settings``: each plugin's, by
    name); later calls return the same report."""
    global _report
    with _lock:
        if _report is None:
            env = os.environ if environ is None else environ
            _report = _load(_Settings.from_env(env, settings))
        if _report.api_errors:
            raise PluginAPIError("; ".join(_report.api_errors))
        if _report.platform_error:
            raise PlatformError(_report.platform_error, _report)
        return _report


def plugin_report() -> PluginReport | None:
    """The report of the ``load_plugins()`` that ran in this process, if any."""
    return _report


@functools.cache
def current_platform() -> Any:
    """The active ``Platform`` instance (loading plugins first if nobody has)."""
    report = load_plugins()
    return PLATFORMS.get(report.platform)()


def reset_plugins() -> None:
    """Forget the loaded state (tests). Hooks and registry entries stay as they are."""
    global _report
    with _lock:
        _report = None
        current_platform.cache_clear()


def _load(settings: _Settings) -> PluginReport:
    report = PluginReport(
        allowlist=None if settings.allowlist is None else tuple(sorted(settings.allowlist))
    )
    excluded_dists = _choose_platform(settings, report)
    for ep in _discover(PLUGIN_GROUP):
        info = _info(ep, PLUGIN_GROUP)
        report.plugins.append(info)
        if not settings.allows(ep.name):
            info.status = "not allowed"
        elif info.dist and info.dist in excluded_dists:
            info.status = "skipped"
            info.error = f"its distribution {info.dist!r} ships a platform that is not active"
        else:
            given = PluginSettings(ep.name, settings.plugins.get(ep.name))
            report.settings[ep.name] = dict(given)
            _call(ep, info, report, "register", given)
            if not info.error:
                info.status = "loaded"
    known = {p.name for p in report.plugins + report.platforms}
    if settings.allowlist:
        for name in sorted(settings.allowlist - known):
            _fail(report, f"ACTORLM_PLUGINS names {name!r}, which no installed plugin provides")
    for name in sorted(set(settings.plugins) - known):
        _fail(report, f"--plugin-config names {name!r}, which no installed plugin provides")
    report.errors += [str(e) for e in HookRegistry.apply_hooks()]
    return report


def _choose_platform(settings: _Settings, report: PluginReport) -> set[str]:
    """Fill ``report.platform``; return the distributions whose plugins must not load."""
    eps = _discover(PLATFORM_GROUP)
    pairs = [(ep, _info(ep, PLATFORM_GROUP)) for ep in eps]
    report.platforms = [info for _, info in pairs]
    if settings.platform is not None:
        wanted = [(ep, info) for ep, info in pairs if ep.name == settings.platform]
        for _, info in pairs:
            info.status = "not selected"
        if settings.platform in BUILTIN_PLATFORMS and not wanted:
            if PLATFORMS.get(settings.platform).is_available():
                report.platform = settings.platform
            else:
                _platform_fail(
                    report,
                    f"ACTORLM_PLATFORM={settings.platform!r}: the built-in platform's "
                    "hardware is not available here",
                )
        elif not wanted:
            found = ", ".join(sorted({ep.name for ep in eps} | set(BUILTIN_PLATFORMS)))
            _platform_fail(
                report, f"ACTORLM_PLATFORM={settings.platform!r} is not installed; found: {found}"
            )
        else:
            ep, info = wanted[0]
            if _activate(ep, info, report):
                report.platform = ep.name
            elif not info.error:
                _platform_fail(
                    report,
                    f"ACTORLM_PLATFORM={ep.name!r}: its activate() returned None "
                    f"(the {ep.name} hardware is not available here)",
                )
            else:
                _platform_fail(report, f"ACTORLM_PLATFORM={ep.name!r} failed: {info.error}")
    else:
        active = []
        for ep, info in pairs:
            if not settings.allows(ep.name):
                info.status = "not allowed"
            elif _activate(ep, info, report):
                active.append(ep.name)
        if len(active) > 1:
            _platform_fail(
                report,
                f"several platform plugins are active ({', '.join(active)}); "
                "choose one with ACTORLM_PLATFORM",
            )
        elif active:
            report.platform = active[0]
        else:
            report.platform = "cuda" if PLATFORMS.get("cuda").is_available() else "cpu"
    chosen = {i.dist for i in report.platforms if i.name == report.platform and i.dist}
    return {i.dist for i in report.platforms if i.dist} - chosen


def _activate(ep: EntryPoint, info: PluginInfo, report: PluginReport) -> bool:
    """Run ``activate()``; register the returned class path under the entry point's name."""
    path = _call(ep, info, report, "activate")
    if info.error:
        return False
    if path is None:
        info.status = "inactive"
        return False
    if not isinstance(path, str):  # a class object is fine too
        path = f"{path.__module__}:{path.__qualname__}"
    PLATFORMS.register(ep.name, path, source=ep.name, help=f"platform plugin ({info.dist})")
    info.status = "active"
    return True


def _accepts_settings(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    )


def _api_problem(ep: EntryPoint, info: PluginInfo, fn: Any) -> str:
    """Why the plugin cannot run on this API_VERSION ("" if it can, or says nothing)."""
    wanted = getattr(inspect.getmodule(fn), "REQUIRES_API", None)
    if wanted is None:
        return ""
    accepted = wanted if isinstance(wanted, (tuple, list, set, frozenset, range)) else (wanted,)
    if API_VERSION in accepted:
        return ""
    where = f" (distribution {info.dist})" if info.dist else ""
    return (
        f"plugin {ep.name!r}{where} requires the plugin API {wanted!r}; this actorlm "
        f"provides API {API_VERSION}"
    )


def _call(
    ep: EntryPoint, info: PluginInfo, report: PluginReport, what: str, settings: Any = None
) -> Any:
    """Import the entry point and call it attributed to its plugin; failures are recorded."""
    token = current_source.set(ep.name)
    try:
        fn: Callable[..., Any] = ep.load()
        problem = _api_problem(ep, info, fn)
        if problem:
            info.status, info.error = "failed", problem
            report.api_errors.append(problem)
            report.errors.append(problem)
            return None
        if settings is not None and _accepts_settings(fn):
            return fn(settings)
        return fn()
    except Exception as exc:  # a broken plugin must not stop the others
        info.status = "failed"
        info.error = f"{exc.__class__.__name__}: {exc}"
        where = f" (distribution {info.dist})" if info.dist else ""
        _fail(report, f"plugin {ep.name!r}{where} failed in {what}: {info.error}")
        log.debug("plugin %s traceback", ep.name, exc_info=True)
        return None
    finally:
        current_source.reset(token)


def _discover(group: str) -> list[EntryPoint]:
    """The group's entry points in name order, so plugins register (and their hooks
    and interceptors compose) in the same order on every machine."""
    # The same distribution can sit twice on sys.path (an editable install and a
    # PYTHONPATH copy): keep the first, as importing would.
    seen: set[tuple[str, str]] = set()
    out = []
    for ep in entry_points(group=group):
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            out.append(ep)
    return sorted(out, key=lambda ep: ep.name)  # stable: same-name duplicates keep path order


def _info(ep: EntryPoint, group: str) -> PluginInfo:
    dist = ep.dist.name if ep.dist is not None else ""
    return PluginInfo(ep.name, group, ep.value, dist)


def _fail(report: PluginReport, message: str) -> None:
    report.errors.append(message)
    log.error("%s", message)


def _platform_fail(report: PluginReport, message: str) -> None:
    # Not logged: load_plugins raises it, and whoever catches it says it once.
    report.platform_error = message
    report.errors.append(message)
