"""Function hooks: a plugin patches a function, method or class named by dotted path.

Targets are ``"pkg.mod.func"``, ``"pkg.mod.Class.method"`` or ``"pkg.mod.Class"``.
Hook kinds (``fn`` is the hook, ``args``/``kwargs`` the call's arguments, ``self``
or ``cls`` included for methods):

* ``BEFORE``  ``fn(*args, **kwargs)`` runs first. It returns ``None`` to keep the
  arguments, or a pair ``(args: tuple, kwargs: dict)`` that replaces them.
* ``AFTER``   ``fn(result, *args, **kwargs)`` runs last, with the (possibly
  rewritten) arguments. It returns a new result, or ``None`` to keep the old one
  (to make a call return ``None``, use ``AROUND``).
* ``AROUND``  ``fn(original, *args, **kwargs)``; calling ``original`` runs the rest
  of the chain.
* ``REPLACE`` ``fn`` takes the target's place. On a class target only ``REPLACE``
  is allowed; method hooks registered for ``"pkg.mod.Class.m"`` then apply to the
  replacement's ``m`` (inherited or overridden), because class targets are applied
  before the targets below them.

Composition, for one target, outermost first::

    BEFORE hooks, in registration order
      AROUND hooks, the first registered outermost
        the last registered REPLACE (a warning names any it overrides), else the original
    AFTER hooks, in registration order

Methods stay what they were: a staticmethod or classmethod is unwrapped, wrapped
and rewrapped. An ``async def`` target stays an ``async def``; its hooks may be
sync or async (a returned awaitable is awaited). A sync target rejects async
hooks, since nothing could await them.

``apply_hooks()`` is idempotent. A hook registered after it ran is applied at
once (everything is undone and re-applied: simple, and late registrations are
rare). Besides the target's own binding, every module attribute that *is* the
original object (``from pkg.mod import func`` done before the patch) is
re-pointed too, except in the modules that define the hooks: there an imported
name keeps meaning the original, so a replacement may call it. That costs one
pass over every attribute of every module in ``sys.modules`` per apply (tens
of milliseconds with torch loaded); modules
imported later read the patched attribute themselves. References held
elsewhere (dict values, default arguments, other classes' attributes) keep the
original. A target that cannot be patched is recorded as a ``HookError`` naming
the plugin, logged, and skipped; the other hooks still apply.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .moved import current_path
from .registry import current_source
from .surface import declared

__all__ = [
    "Hook",
    "HookApplyError",
    "HookError",
    "HookInfo",
    "HookRegistry",
    "HookType",
    "plugin_hook",
]

log = logging.getLogger(__name__)
F = TypeVar("F")


class HookType(enum.StrEnum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


@dataclass(frozen=True)
class Hook:
    target: str
    fn: Callable[..., Any]
    type: HookType
    source: str

    @property
    def fn_name(self) -> str:
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"


@dataclass(frozen=True)
class HookInfo:
    """One registered hook as ``actorlm plugins`` shows it."""

    target: str
    type: str
    source: str
    fn: str
    status: str  # applied | pending | failed


@dataclass(frozen=True)
class HookError:
    target: str
    sources: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"hook on {self.target!r} from plugin {', '.join(self.sources)}: {self.message}"


class HookApplyError(RuntimeError):
    def __init__(self, errors: list[HookError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


@dataclass
class _Binding:
    """One attribute we overwrote, and how to put it back."""

    owner: Any
    name: str
    original: Any
    patched: Any
    had_own: bool  # False: the value was inherited or came from a module __getattr__


class HookRegistry:
    """Process-wide hook state. Plugins register in their ``register()``, before any
    actor starts, so one registry per process (like the named registries) is the
    honest shape; ``reset()`` and ``isolated()`` exist for tests."""

    _hooks: ClassVar[list[Hook]] = []
    _bindings: ClassVar[list[_Binding]] = []
    _failed: ClassVar[set[str]] = set()
    _warned: ClassVar[set[str]] = set()  # undeclared targets already logged
    _errors: ClassVar[list[HookError]] = []
    _applied: ClassVar[bool] = False
    _lock: ClassVar[threading.RLock] = threading.RLock()

    @classmethod
    def register(
        cls, target: str, fn: Callable[..., Any], type: HookType | str, *, source: str | None = None
    ) -> Callable[..., Any]:
        # An old module path (moved.py) names the same target as the new one: one
        # target, so that their hooks order and override as one method's do.
        target = current_path(target)
        hook = Hook(target, fn, HookType(type), source or current_source.get())
        if not declared(target) and target not in cls._warned:
            cls._warned.add(target)
            log.warning(
                "hook target %s (from %s) is outside the stable hook surface: it may change "
                "without notice (`actorlm plugins --hooks` lists the declared targets)",
                target,
                hook.source,
            )
        with cls._lock:
            # register() may run twice (a module imported twice): one hook, not two.
            if not any(
                h.target == target and h.fn is fn and h.type is hook.type for h in cls._hooks
            ):
                cls._hooks.append(hook)
            if cls._applied:
                cls._applied = False
                cls.apply_hooks()
        return fn

    @classmethod
    def apply_hooks(cls, *, strict: bool = False) -> list[HookError]:
        """Patch every target. Returns the errors; ``strict`` raises them instead."""
        with cls._lock:
            if not cls._applied:
                cls._undo_bindings()
                cls._errors, cls._failed = [], set()
                by_target: dict[str, list[Hook]] = {}
                for hook in cls._hooks:
                    by_target.setdefault(hook.target, []).append(hook)
                # Shallow first: a class REPLACE lands before the method hooks under it.
                for target in sorted(by_target, key=lambda t: t.count(".")):
                    try:
                        cls._bindings.append(_patch_target(target, by_target[target]))
                    except Exception as exc:  # any failure is the plugin's, reported, not fatal
                        error = HookError(
                            target,
                            tuple(dict.fromkeys(h.source for h in by_target[target])),
                            f"{exc.__class__.__name__}: {exc}",
                        )
                        cls._errors.append(error)
                        cls._failed.add(target)
                        log.error("%s", error)
                swaps = {
                    id(b.original): (b.original, b.patched)
                    for b in cls._bindings
                    if isinstance(b.owner, types.ModuleType)
                }
                # A plugin's own module keeps its names: `from m import f` there means
                # "the original" (a REPLACE calling it would otherwise call itself).
                own = {getattr(h.fn, "__module__", None) for h in cls._hooks}
                cls._bindings += _rebind_aliases(swaps, cls._bindings, own)
                cls._applied = True
            if strict and cls._errors:
                raise HookApplyError(list(cls._errors))
            return list(cls._errors)

    @classmethod
    def undo(cls) -> None:
        """Restore every binding patched so far; registered hooks stay registered."""
        with cls._lock:
            cls._undo_bindings()
            cls._applied = False

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls.undo()
            cls._hooks, cls._errors, cls._failed = [], [], set()

    @classmethod
    @contextlib.contextmanager
    def isolated(cls) -> Iterator[type[HookRegistry]]:
        """Run a block with an empty registry; afterwards undo its patches and put
        back (and re-apply) whatever was there before."""
        with cls._lock:
            saved = (list(cls._hooks), cls._applied)
            cls.reset()
        try:
            yield cls
        finally:
            with cls._lock:
                cls.reset()
                cls._hooks = saved[0]
                if saved[1]:
                    cls.apply_hooks()

    @classmethod
    def hooks(cls) -> list[HookInfo]:
        def status(target: str) -> str:
            if target in cls._failed:
                return "failed"
            return "applied" if cls._applied else "pending"

        return [
            HookInfo(h.target, h.type.value, h.source, h.fn_name, status(h.target))
            for h in cls._hooks
        ]

    @classmethod
    def errors(cls) -> list[HookError]:
        return list(cls._errors)

    @classmethod
    def is_applied(cls) -> bool:
        return cls._applied

    @classmethod
    def _undo_bindings(cls) -> None:
        bindings, cls._bindings = cls._bindings, []
        # Names bound by `from x import y` after the patch hold the patched object too.
        back = {
            id(b.patched): (b.patched, b.original)
            for b in bindings
            if isinstance(b.owner, types.ModuleType)
        }
        _rebind_aliases(back, bindings)
        for b in reversed(bindings):
            if b.had_own:
                setattr(b.owner, b.name, b.original)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(b.owner, b.name)


def plugin_hook(
    target: str, type: HookType | str = HookType.AROUND, *, source: str | None = None
) -> Callable[[F], F]:
    """Decorator form of ``HookRegistry.register``; returns the hook unchanged."""

    def decorator(fn: F) -> F:
        HookRegistry.register(target, fn, type, source=source)  # type: ignore[arg-type]
        return fn

    return decorator


def _resolve(target: str) -> tuple[Any, str, Any, bool]:
    """``(owner, name, raw attribute, owner holds it itself)`` for a dotted target."""
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise LookupError("a target is a dotted path like 'pkg.mod.func' or 'pkg.mod.Class.method'")
    owner: Any = None
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            owner = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" means try a shorter one; a module
            # whose own import fails is a real error to report.
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue
            raise
        break
    if owner is None:
        raise LookupError(f"no module {parts[0]!r}")
    for depth, part in enumerate(parts[i:-1], start=i):
        if not hasattr(owner, part):
            raise LookupError(f"{'.'.join(parts[:depth])!r} has no attribute {part!r}")
        owner = getattr(owner, part)
    name = parts[-1]
    if isinstance(owner, types.ModuleType):
        if name in vars(owner):
            return owner, name, vars(owner)[name], True
        if hasattr(owner, name):  # a module-level __getattr__ provides it
            return owner, name, getattr(owner, name), False
    elif isinstance(owner, type):
        with contextlib.suppress(AttributeError):
            # getattr_static: the raw staticmethod/classmethod, through the MRO.
            return owner, name, inspect.getattr_static(owner, name), name in vars(owner)
    else:
        raise LookupError(f"{'.'.join(parts[:-1])!r} is neither a module nor a class")
    raise LookupError(f"{'.'.join(parts[:-1])!r} has no attribute {name!r}")


def _patch_target(target: str, hooks: list[Hook]) -> _Binding:
    owner, name, raw, had_own = _resolve(target)
    replaces = [h for h in hooks if h.type is HookType.REPLACE]
    if len(replaces) > 1:
        log.warning(
            "%s: REPLACE hooks from %s; the last one (%s) wins",
            target,
            ", ".join(h.source for h in replaces),
            replaces[-1].source,
        )
    if isinstance(raw, type):
        if len(replaces) != len(hooks):
            raise TypeError("a class target takes only REPLACE; hook its methods as 'Class.method'")
        patched: Any = replaces[-1].fn
    elif isinstance(raw, (staticmethod, classmethod)):
        patched = raw.__class__(_compose(target, raw.__func__, hooks))
    elif callable(raw):
        patched = _compose(target, raw, hooks)
    else:
        raise TypeError(f"not a function, method or class (a {raw.__class__.__name__})")
    setattr(owner, name, patched)
    return _Binding(owner, name, raw, patched, had_own)


def _compose(target: str, original: Callable[..., Any], hooks: list[Hook]) -> Callable[..., Any]:
    replaces = [_unwrap(h.fn) for h in hooks if h.type is HookType.REPLACE]
    befores = [h.fn for h in hooks if h.type is HookType.BEFORE]
    arounds = [h.fn for h in hooks if h.type is HookType.AROUND]
    afters = [h.fn for h in hooks if h.type is HookType.AFTER]
    base = replaces[-1] if replaces else original
    if not (befores or arounds or afters):
        return base
    is_async = inspect.iscoroutinefunction(original)
    if not is_async:
        for h in hooks:
            if h.type is not HookType.REPLACE and inspect.iscoroutinefunction(h.fn):
                raise TypeError(
                    f"async {h.type.value} hook {h.fn_name} cannot wrap the synchronous {target}"
                )
    chain = base
    for fn in reversed(arounds):  # built inside out, so the first registered is outermost
        chain = _bind_around(fn, chain, is_async)
    wrapper = (
        _async_wrapper(chain, befores, afters)
        if is_async
        else _sync_wrapper(chain, befores, afters)
    )
    functools.update_wrapper(wrapper, original)
    wrapper.__actorlm_hooks__ = tuple(hooks)  # type: ignore[attr-defined]
    return wrapper


def _unwrap(fn: Any) -> Any:
    # A replacement written as @staticmethod/@classmethod: the target's own kind is restored.
    return fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn


Args = tuple[tuple[Any, ...], dict[str, Any]]


def _rewritten(
    fn: Callable[..., Any], out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Args:
    if out is None:
        return args, kwargs
    if (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], tuple)
        and isinstance(out[1], dict)
    ):
        return out
    raise TypeError(
        f"BEFORE hook {getattr(fn, '__qualname__', fn)!r} must return None or (args: tuple, "
        f"kwargs: dict), not {out.__class__.__name__}"
    )


async def _resolved(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _bind_around(
    fn: Callable[..., Any], inner: Callable[..., Any], is_async: bool
) -> Callable[..., Any]:
    if not is_async:
        return functools.partial(fn, inner)

    async def around(*args: Any, **kwargs: Any) -> Any:
        return await _resolved(fn(inner, *args, **kwargs))

    return around


def _sync_wrapper(
    chain: Callable[..., Any], befores: list[Callable[..., Any]], afters: list[Callable[..., Any]]
) -> Callable[..., Any]:
    def hooked(*args: Any, **kwargs: Any) -> Any:
        for fn in befores:
            args, kwargs = _rewritten(fn, fn(*args, **kwargs), args, kwargs)
        result = chain(*args, **kwargs)
        for fn in afters:
            new = fn(result, *args, **kwargs)
            if new is not None:
                result = new
        return result

    return hooked


def _async_wrapper(
    chain: Callable[..., Any], befores: list[Callable[..., Any]], afters: list[Callable[..., Any]]
) -> Callable[..., Any]:
    async def hooked(*args: Any, **kwargs: Any) -> Any:
        for fn in befores:
            args, kwargs = _rewritten(fn, await _resolved(fn(*args, **kwargs)), args, kwargs)
        result = await _resolved(chain(*args, **kwargs))
        for fn in afters:
            new = await _resolved(fn(result, *args, **kwargs))
            if new is not None:
                result = new
        return result

    return hooked


def _rebind_aliases(
    swaps: dict[int, tuple[Any, Any]], known: list[_Binding], keep: Iterable[str | None] = ()
) -> list[_Binding]:
    """Point every module attribute that *is* an old object at its new one.

    ``swaps`` maps ``id(old)`` to ``(old, new)``; ids keep the lookup cheap and
    work for unhashable attributes. Bindings in ``known`` are handled by the caller;
    modules named in ``keep`` are left alone.
    """
    if not swaps:
        return []
    skip = {(id(b.owner), b.name) for b in known}
    rebound: list[_Binding] = []
    kept = set(keep)
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or getattr(module, "__name__", None) in kept:
            continue
        namespace = vars(module)
        for name, value in list(namespace.items()):
            swap = swaps.get(id(value))
            if swap is None or swap[0] is not value or (id(module), name) in skip:
                continue
            namespace[name] = swap[1]
            rebound.append(_Binding(module, name, value, swap[1], True))
    return rebound
