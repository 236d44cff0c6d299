"""Typed extension points: a plugin whose entry does not implement its registry's
interface fails at load, with the plugin's distribution, the entry and the member
named; a well-shaped entry loads (issue 25)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .distbuilder import run_python, write_distribution

# (registry, a wrongly-shaped entry, what the error must say)
BAD = {
    "ATTENTION_BACKENDS": ("class Bad:\n    pass\n", "has no forward"),
    "WEIGHT_LOADERS": (
        "from actorlm.gpu.loaders.base import WeightLoader\n\n"
        "class Bad(WeightLoader):\n    def model_info(self):\n        return None\n",
        "does not implement WeightLoader.weights",
    ),
    "EVICTION_POLICIES": (
        "class Bad:\n    def priority(self):\n        return ()\n",
        "its priority takes 1 positional parameter(s) where EvictionStrategy.priority",
    ),
    "HICACHE_STORAGE": ("Bad = object()\n", "must be a class implementing HiCacheStorage"),
    "LOGIT_PROCESSORS": (
        "class Bad:\n    __call__ = 5\n",
        "not a method",
    ),
    "PLATFORMS": ("class Bad:\n    pass\n", "must subclass actorlm.gpu.platforms.Platform"),
    "QUANTIZATION_METHODS": (
        "from actorlm.gpu.quantization import LinearMethod\n\nclass Bad(LinearMethod):\n    pass\n",
        "does not implement LinearMethod.convert",
    ),
    "MODELS": ("class Bad:\n    pass\n", "must subclass torch.nn.modules.module.Module"),
}

DRIVER = """
import dataclasses, json
from actorlm.extensions import plugins
report = plugins.load_plugins()
print(json.dumps({p.name: [p.status, p.error] for p in report.plugins}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("typed")
    for point, (source, _) in BAD.items():
        pkg = f"bad_{point.lower()}"
        write_distribution(
            site,
            f"{pkg.replace('_', '-')}-dist",
            {
                f"{pkg}/__init__.py": source
                + "\n\ndef register():\n"
                + "    from actorlm.extensions import points\n"
                + f"    getattr(points, {point!r}).register('bad', Bad)\n"
            },
            {"actorlm.plugins": {pkg: f"{pkg}:register"}},
        )
    write_distribution(
        site,
        "good-dist",
        {
            "good_plugin/__init__.py": """
                from actorlm.actors.cache.eviction import EvictionStrategy
                from actorlm.extensions.points import EVICTION_POLICIES


                class Newest(EvictionStrategy):
                    def priority(self, node):
                        return (-node.last_access_time,)


                def register():
                    EVICTION_POLICIES.register("newest", Newest)
            """
        },
        {"actorlm.plugins": {"good": "good_plugin:register"}},
    )
    return site


@pytest.fixture(scope="module")
def report(site: Path) -> dict[str, list[str]]:
    proc = run_python(["-c", DRIVER], [site])
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("point", sorted(BAD))
def test_a_wrongly_shaped_entry_fails_at_load(report: dict[str, list[str]], point: str) -> None:
    status, error = report[f"bad_{point.lower()}"]
    assert status == "failed"
    assert "EntryTypeError" in error and "'bad' registered by" in error, error
    assert BAD[point][1] in error, error


def test_a_well_shaped_entry_loads(report: dict[str, list[str]]) -> None:
    assert report["good"] == ["loaded", ""]


def test_the_error_names_the_distribution(site: Path) -> None:
    proc = run_python(
        ["-c", DRIVER.replace("print(json.dumps", "print(report.errors) or print(json.dumps")],
        [site],
    )
    assert "bad-eviction-policies-dist" in proc.stdout.replace("_", "-")
