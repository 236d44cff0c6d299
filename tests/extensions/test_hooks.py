"""HookRegistry on real modules: each test writes a fresh package, imports it, hooks it."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from actorlm.extensions.hooks import HookApplyError, HookRegistry, HookType, plugin_hook
from actorlm.extensions.registry import current_source

TARGET_SOURCE = """
import asyncio

log = []


def add(a, b):
    return a + b


async def fetch(x):
    await asyncio.sleep(0)
    return x * 2


class Greeter:
    greeting = "hello"

    def greet(self, name):
        return f"{self.greeting} {name}"

    @classmethod
    def make(cls, greeting):
        g = cls()
        g.greeting = greeting
        return g

    @staticmethod
    def shout(text):
        return text.upper()

    async def agreet(self, name):
        await asyncio.sleep(0)
        return self.greet(name)


class Loud(Greeter):
    pass
"""


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """A fresh package ``hookdemo_<id>`` with ``mod`` and ``user`` (which does
    ``from <pkg>.mod import ...``), and an empty HookRegistry for the test."""
    name = f"hookdemo_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(TARGET_SOURCE)
    (pkg / "user.py").write_text(
        f"from {name}.mod import Greeter, add, fetch\n\n\n"
        "def call_add(a, b):\n    return add(a, b)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with HookRegistry.isolated():
        mod = importlib.import_module(f"{name}.mod")
        user = importlib.import_module(f"{name}.user")
        yield SimpleNamespace(name=name, mod=mod, user=user, root=tmp_path, t=f"{name}.mod.")
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def late_module(demo: SimpleNamespace, stem: str, source: str) -> ModuleType:
    (demo.root / demo.name / f"{stem}.py").write_text(source)
    importlib.invalidate_caches()
    return importlib.import_module(f"{demo.name}.{stem}")


def test_before_rewrites_or_keeps_arguments(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda a, b: ((a, 10), {}), HookType.BEFORE)
    HookRegistry.register(demo.t + "add", lambda a, b: demo.mod.log.append(b), HookType.BEFORE)
    HookRegistry.apply_hooks(strict=True)
    assert demo.mod.add(1, 2) == 11
    assert demo.mod.log == [10]  # the second BEFORE saw the first one's rewrite


def test_before_with_a_bad_return_names_the_hook(demo: SimpleNamespace) -> None:
    def bad(a: int, b: int) -> int:
        return 3

    HookRegistry.register(demo.t + "add", bad, HookType.BEFORE)
    HookRegistry.apply_hooks(strict=True)
    with pytest.raises(TypeError, match="bad.*must return None or"):
        demo.mod.add(1, 2)


def test_after_replaces_result_unless_none(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda r, a, b: r * 100, HookType.AFTER)
    HookRegistry.register(demo.t + "add", lambda r, a, b: demo.mod.log.append((r, a, b)), "after")
    HookRegistry.apply_hooks(strict=True)
    assert demo.mod.add(1, 2) == 300
    assert demo.mod.log == [(300, 1, 2)]


def test_around_and_replace(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda orig, a, b: orig(a, b) + 1, HookType.AROUND)
    HookRegistry.register(demo.t + "add", lambda a, b: a * b, HookType.REPLACE)
    HookRegistry.apply_hooks(strict=True)
    assert demo.mod.add(3, 4) == 13  # AROUND wraps the replacement
    assert demo.mod.add.__wrapped__ is not demo.mod.add


def test_composition_order(demo: SimpleNamespace) -> None:
    log = demo.mod.log
    t = demo.t + "add"

    def around(tag: str):
        def hook(orig, a, b):
            log.append(f"{tag}>")
            out = orig(a, b)
            log.append(f"<{tag}")
            return out

        return hook

    def replacement(a: int, b: int) -> int:
        log.append("replace")
        return a - b

    HookRegistry.register(t, lambda a, b: log.append("before1"), HookType.BEFORE)
    HookRegistry.register(t, around("around1"), HookType.AROUND)
    HookRegistry.register(t, lambda r, a, b: log.append("after1"), HookType.AFTER)
    HookRegistry.register(t, around("around2"), HookType.AROUND)
    HookRegistry.register(t, lambda a, b: log.append("before2"), HookType.BEFORE)
    HookRegistry.register(t, lambda a, b: log.append("lost replace"), HookType.REPLACE)
    HookRegistry.register(t, replacement, HookType.REPLACE)
    HookRegistry.register(t, lambda r, a, b: log.append("after2"), HookType.AFTER)
    HookRegistry.apply_hooks(strict=True)
    assert demo.mod.add(5, 3) == 2
    assert log == [
        "before1",
        "before2",
        "around1>",
        "around2>",
        "replace",
        "<around2",
        "<around1",
        "after1",
        "after2",
    ]


def test_methods_stay_what_they_were(demo: SimpleNamespace) -> None:
    Greeter, Loud = demo.mod.Greeter, demo.mod.Loud
    HookRegistry.register(demo.t + "Greeter.greet", lambda o, s, n: o(s, n) + "!", "around")
    HookRegistry.register(demo.t + "Greeter.make", lambda r, cls, g: r.greet("made"), "after")
    HookRegistry.register(demo.t + "Greeter.shout", lambda text: ((text + "?",), {}), "before")
    HookRegistry.register(demo.t + "Loud.shout", lambda o, text: o(text) * 2, "around")
    HookRegistry.apply_hooks(strict=True)

    assert inspect.isfunction(vars(Greeter)["greet"])
    assert isinstance(vars(Greeter)["make"], classmethod)
    assert isinstance(vars(Greeter)["shout"], staticmethod)
    assert isinstance(vars(Loud)["shout"], staticmethod)  # inherited, patched on Loud only
    assert Greeter().greet("bob") == "hello bob!"
    assert Greeter.make("hi") == "hi made!"
    assert Greeter.shout("a") == Greeter().shout("a") == "A?"
    assert Loud.shout("a") == "A?A?"  # Loud's AROUND wraps Greeter's hooked staticmethod


def test_classmethod_receives_the_subclass(demo: SimpleNamespace) -> None:
    seen = []
    HookRegistry.register(demo.t + "Greeter.make", lambda cls, g: seen.append(cls), "before")
    HookRegistry.apply_hooks(strict=True)
    made = demo.mod.Loud.make("yo")
    assert seen == [demo.mod.Loud] and isinstance(made, demo.mod.Loud)


def test_async_targets_stay_async_with_sync_and_async_hooks(demo: SimpleNamespace) -> None:
    async def before(x: int) -> tuple[tuple[int], dict[str, int]]:
        await asyncio.sleep(0)
        return (x + 1,), {}

    async def around(orig, x):
        return await orig(x) + 1000

    HookRegistry.register(demo.t + "fetch", before, HookType.BEFORE)
    HookRegistry.register(demo.t + "fetch", around, HookType.AROUND)
    HookRegistry.register(demo.t + "fetch", lambda orig, x: orig(x), HookType.AROUND)  # sync
    HookRegistry.register(demo.t + "fetch", lambda r, x: -r, HookType.AFTER)
    HookRegistry.register(demo.t + "Greeter.agreet", lambda r, s, n: r.title(), "after")
    HookRegistry.apply_hooks(strict=True)

    assert inspect.iscoroutinefunction(demo.mod.fetch)
    assert inspect.iscoroutinefunction(demo.mod.Greeter.agreet)
    assert asyncio.run(demo.mod.fetch(1)) == -(4 + 1000)
    assert asyncio.run(demo.mod.Greeter().agreet("ann")) == "Hello Ann"


def test_async_hook_on_a_sync_target_is_an_error(demo: SimpleNamespace) -> None:
    async def hook(orig, a, b):
        return orig(a, b)

    HookRegistry.register(demo.t + "add", hook, HookType.AROUND, source="asyncplug")
    errors = HookRegistry.apply_hooks()
    assert len(errors) == 1 and "asyncplug" in str(errors[0]) and "synchronous" in str(errors[0])
    assert demo.mod.add(1, 2) == 3


def test_class_replace_receives_method_hooks(demo: SimpleNamespace) -> None:
    Original = demo.mod.Greeter

    @plugin_hook(demo.t + "Greeter", type=HookType.REPLACE)
    class Better(Original):
        def greet(self, name: str) -> str:
            return "better " + super().greet(name)

    # Registered for the original's methods, in any order relative to the REPLACE.
    HookRegistry.register(demo.t + "Greeter.greet", lambda r, s, n: r + "!", HookType.AFTER)
    HookRegistry.register(demo.t + "Greeter.shout", lambda o, t: o(t) + "?", HookType.AROUND)
    HookRegistry.apply_hooks(strict=True)

    assert demo.mod.Greeter is Better and demo.user.Greeter is Better
    assert Better().greet("x") == "better hello x!"  # the hook ran once, not twice via super()
    assert Better.shout("a") == "A?"
    assert isinstance(vars(Better)["shout"], staticmethod)
    assert Original().greet("x") == "hello x" and Original.shout("a") == "A"  # untouched

    HookRegistry.undo()
    assert demo.mod.Greeter is Original and demo.user.Greeter is Original
    assert "shout" not in vars(Better) and Better().greet("x") == "better hello x"


def test_class_target_takes_only_replace(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "Greeter", lambda o: o(), HookType.AROUND, source="p")
    (error,) = HookRegistry.apply_hooks()
    assert "only REPLACE" in error.message and error.sources == ("p",)


def test_apply_is_idempotent(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda orig, a, b: orig(a, b) + 1, HookType.AROUND)
    HookRegistry.apply_hooks()
    patched = demo.mod.add
    HookRegistry.apply_hooks()
    HookRegistry.apply_hooks()
    assert demo.mod.add is patched and demo.mod.add(1, 1) == 3
    # Registering the same function again is one hook, not two.
    HookRegistry.register(demo.t + "add", demo.mod.add.__actorlm_hooks__[0].fn, "around")
    assert demo.mod.add(1, 1) == 3 and len(HookRegistry.hooks()) == 1


def test_late_registration_is_applied_at_once(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda orig, a, b: orig(a, b) + 1, HookType.AROUND)
    HookRegistry.apply_hooks()
    HookRegistry.register(demo.t + "add", lambda r, a, b: r * 10, HookType.AFTER)
    HookRegistry.register(demo.t + "Greeter.greet", lambda r, s, n: r.upper(), HookType.AFTER)
    assert demo.mod.add(1, 1) == 30 and demo.user.add(1, 1) == 30
    assert demo.mod.Greeter().greet("z") == "HELLO Z"


def test_from_import_bindings_are_patched_and_restored(demo: SimpleNamespace) -> None:
    original = demo.mod.add
    HookRegistry.register(demo.t + "add", lambda orig, a, b: orig(a, b) + 1, HookType.AROUND)
    HookRegistry.apply_hooks(strict=True)
    assert demo.user.add is demo.mod.add is not original
    assert demo.user.call_add(1, 1) == 3
    late = late_module(demo, "late", f"from {demo.name}.mod import add\n")
    assert late.add is demo.mod.add  # imported after apply: reads the patched attribute

    HookRegistry.undo()
    assert demo.mod.add is demo.user.add is late.add is original
    assert demo.user.call_add(1, 1) == 2


def test_missing_target_names_the_plugin_and_others_still_apply(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "nope", lambda *a: None, HookType.AFTER, source="acme")
    HookRegistry.register(demo.t + "Greeter.nope", lambda *a: None, "after", source="acme")
    HookRegistry.register(f"{demo.name}.nomodule.f", lambda *a: None, "after", source="acme")
    HookRegistry.register("no_such_package_xyz.f", lambda *a: None, "after", source="zeta")
    HookRegistry.register(demo.t + "add", lambda r, a, b: r + 1, HookType.AFTER, source="good")

    errors = HookRegistry.apply_hooks()
    assert demo.mod.add(1, 1) == 3
    by_target = {e.target: e for e in errors}
    assert set(by_target) == {
        demo.t + "nope",
        demo.t + "Greeter.nope",
        f"{demo.name}.nomodule.f",
        "no_such_package_xyz.f",
    }
    assert by_target["no_such_package_xyz.f"].sources == ("zeta",)
    assert "from plugin acme" in str(by_target[demo.t + "nope"])
    assert "has no attribute 'nope'" in str(by_target[demo.t + "Greeter.nope"])
    assert HookRegistry.errors() == errors
    status = {(h.target, h.source): h.status for h in HookRegistry.hooks()}
    assert status[(demo.t + "add", "good")] == "applied"
    assert status[(demo.t + "nope", "acme")] == "failed"
    HookRegistry.undo()
    with pytest.raises(HookApplyError, match="acme"):
        HookRegistry.apply_hooks(strict=True)


def test_undo_restores_every_binding(demo: SimpleNamespace) -> None:
    mod, user = demo.mod, demo.user
    before = {
        "add": mod.add,
        "fetch": mod.fetch,
        "user.add": user.add,
        "user.Greeter": user.Greeter,
        "Greeter": mod.Greeter,
        **{f"Greeter.{k}": v for k, v in vars(mod.Greeter).items()},
    }
    loud_dict = dict(vars(mod.Loud))
    for target in ("add", "fetch", "Greeter.greet", "Greeter.make", "Greeter.shout", "Loud.greet"):
        HookRegistry.register(demo.t + target, lambda orig, *a: orig(*a), HookType.AROUND)
    HookRegistry.register(demo.t + "Greeter", type("G", (mod.Greeter,), {}), HookType.REPLACE)
    HookRegistry.apply_hooks(strict=True)
    assert mod.add is not before["add"] and "greet" in vars(mod.Loud)

    HookRegistry.undo()
    after = {
        "add": mod.add,
        "fetch": mod.fetch,
        "user.add": user.add,
        "user.Greeter": user.Greeter,
        "Greeter": mod.Greeter,
        **{f"Greeter.{k}": v for k, v in vars(mod.Greeter).items()},
    }
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert dict(vars(mod.Loud)) == loud_dict
    assert not HookRegistry.is_applied() and len(HookRegistry.hooks()) == 7


def test_sources_are_recorded_and_listed(demo: SimpleNamespace) -> None:
    token = current_source.set("myplugin")
    try:

        @plugin_hook(demo.t + "add")
        def timed(orig, a, b):
            return orig(a, b)

    finally:
        current_source.reset(token)
    HookRegistry.register(demo.t + "fetch", lambda r, x: r, HookType.AFTER, source="other")
    assert [h.status for h in HookRegistry.hooks()] == ["pending", "pending"]
    HookRegistry.apply_hooks()
    listed = [(h.target, h.type, h.source, h.status) for h in HookRegistry.hooks()]
    assert listed == [
        (demo.t + "add", "around", "myplugin", "applied"),
        (demo.t + "fetch", "after", "other", "applied"),
    ]
    assert HookRegistry.hooks()[0].fn.endswith("timed")


def test_isolated_puts_back_the_outer_hooks(demo: SimpleNamespace) -> None:
    HookRegistry.register(demo.t + "add", lambda r, a, b: r + 1, HookType.AFTER)
    HookRegistry.apply_hooks()
    with HookRegistry.isolated():
        assert demo.mod.add(1, 1) == 2 and HookRegistry.hooks() == []
        HookRegistry.register(demo.t + "add", lambda r, a, b: r * 10, HookType.AFTER)
        HookRegistry.apply_hooks()
        assert demo.mod.add(1, 1) == 20
    assert demo.mod.add(1, 1) == 3 and len(HookRegistry.hooks()) == 1


def test_a_plugin_module_keeps_the_originals_it_imported(demo: SimpleNamespace) -> None:
    """A REPLACE that calls the function it replaces (imported by name) must not
    call itself, and a replacement class may call its base class by name."""
    plugin = late_module(
        demo,
        "plugin",
        f"""
from {demo.name}.mod import Greeter, add as base_add


def add(a, b):
    return base_add(a, b) * 10


class Greeter2(Greeter):
    def greet(self, name):
        return Greeter.greet(self, name).upper()
""",
    )
    HookRegistry.register(demo.t + "add", plugin.add, HookType.REPLACE)
    HookRegistry.register(demo.t + "Greeter", plugin.Greeter2, HookType.REPLACE)
    HookRegistry.apply_hooks(strict=True)
    assert demo.user.call_add(1, 2) == 30
    assert demo.user.Greeter is plugin.Greeter2 and plugin.Greeter is not plugin.Greeter2
    assert demo.mod.Greeter().greet("x") == "HELLO X"


def test_an_old_module_path_and_the_new_one_name_one_target() -> None:
    # actorlm.actors.policy moved to actorlm.actors.scheduler.policy (extensions/moved.py):
    # hooks named either way order and override as one method's hooks do
    import actorlm.actors.policy as old
    from actorlm.actors.scheduler.policy import BatchPlanner

    assert old.BatchPlanner is BatchPlanner
    calls: list[str] = []
    with HookRegistry.isolated():
        HookRegistry.register(
            "actorlm.actors.policy.BatchPlanner.add",
            lambda *a: calls.append("before, old path"),
            HookType.BEFORE,
        )
        HookRegistry.register(
            "actorlm.actors.scheduler.policy.BatchPlanner.add",
            lambda *a: calls.append("replace, new path"),
            HookType.REPLACE,
        )
        HookRegistry.register(
            "actorlm.actors.policy.BatchPlanner.add",
            lambda *a: calls.append("replace, old path"),
            HookType.REPLACE,
        )
        assert HookRegistry.apply_hooks() == []
        assert {h.target for h in HookRegistry.hooks()} == {
            "actorlm.actors.scheduler.policy.BatchPlanner.add"
        }
        BatchPlanner.add(object(), object(), "x")  # type: ignore[arg-type]
    assert calls == ["before, old path", "replace, old path"]  # the last REPLACE wins
