"""The declared hook surface holds still: its signatures are snapshotted (changing one
means raising API_VERSION and the snapshot together), a plugin requiring another API
fails at start in one line, and an undeclared target works but says so, once (issue 25)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from actorlm.extensions import API_VERSION
from actorlm.extensions.hooks import HookRegistry, HookType
from actorlm.extensions.surface import HOOK_TARGETS, declared, signature_of

from .distbuilder import run_python, write_distribution

SNAPSHOT = Path(__file__).with_name("hook_surface.json")


def test_the_declared_signatures_match_the_snapshot() -> None:
    snap = json.loads(SNAPSHOT.read_text())
    now = {t.target: signature_of(t.target) for t in HOOK_TARGETS}
    changed = {
        t: (snap["targets"].get(t), sig) for t, sig in now.items() if snap["targets"].get(t) != sig
    }
    assert not changed and set(now) == set(snap["targets"]), (
        f"the declared hook surface changed: {changed or set(now) ^ set(snap['targets'])}. "
        "If that is meant, raise actorlm.extensions.API_VERSION and rewrite "
        f"{SNAPSHOT.name} (plugins declaring REQUIRES_API will then say so at start)"
    )
    assert snap["api_version"] == API_VERSION


def test_an_undeclared_target_works_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    target = "actorlm.messages.sampling.check_sampling"
    assert not declared(target) and declared("actorlm.gpu.sampling.Sampler.sample")
    with HookRegistry.isolated(), caplog.at_level(logging.WARNING):
        seen: list[int] = []
        HookRegistry.register(target, lambda p, v: seen.append(v), HookType.BEFORE)
        HookRegistry.register(target, lambda p, v: None, HookType.BEFORE)
        HookRegistry.apply_hooks(strict=True)
        from actorlm.messages import sampling

        sampling.check_sampling(sampling.SamplingParams(), 10)
        assert seen == [10]
    warnings = [r for r in caplog.records if "outside the stable hook surface" in r.getMessage()]
    assert len(warnings) == 1 and target in warnings[0].getMessage()


def test_a_plugin_requiring_another_api_fails_at_start_in_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_distribution(
        site,
        "future-plugin",
        {"future_plugin.py": f"REQUIRES_API = {API_VERSION + 1}\n\ndef register():\n    pass\n"},
        {"actorlm.plugins": {"future": "future_plugin:register"}},
    )
    proc = run_python(["-m", "actorlm.cli", "serve", "--model", "/nowhere"], [site])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("actorlm: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"requires the plugin API {API_VERSION + 1}" in errors[0]
    assert "future-plugin" in errors[0] and "Traceback" not in proc.stderr
