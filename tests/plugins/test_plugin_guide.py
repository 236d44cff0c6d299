"""The plugin guide's examples are the files the plugin tests install and run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
GUIDE = ROOT / "docs" / "plugins.md"
# A quoted file: the marker names it, the fenced block right below holds it whole.
QUOTE = re.compile(r"<!-- file: (\S+) -->\n```[a-z]*\n(.*?)^```$", re.S | re.M)


def test_every_example_file_is_quoted_verbatim() -> None:
    quoted = {path: body for path, body in QUOTE.findall(GUIDE.read_text())}
    for path, body in quoted.items():
        assert (ROOT / path).read_text() == body, f"docs/plugins.md is out of date with {path}"
    packages = ROOT / "tests" / "plugins"
    wanted = {
        str(p.relative_to(ROOT))
        for pattern in ("actorlm_example_*/pyproject.toml", "actorlm_example_*/*/*.py")
        for p in packages.glob(pattern)
        if p.name != "record.py" or "actorlm_example_plugin" in p.parts
    }
    wanted.add("tests/plugins/test_harness_example.py")
    assert wanted - quoted.keys() == set(), "files of the example packages the guide leaves out"


def test_the_guide_covers_every_kind_and_setting() -> None:
    text = GUIDE.read_text()
    for needle in (
        "ACTORLM_PLUGINS",
        "ACTORLM_PLATFORM",
        "HookRegistry.register",
        "@plugin_hook",
        "@message_interceptor",
        "activate()",
        "ActorHarness",
        "the first registered outermost",  # hook order
    ):
        assert needle in text, needle
