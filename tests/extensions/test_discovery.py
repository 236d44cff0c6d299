"""Plugin discovery and the ACTORLM_PLUGINS / ACTORLM_PLATFORM rules, end to end.

Real distributions (dist-info + package) are written into a folder that a fresh
interpreter gets on PYTHONPATH, so importlib.metadata discovers them as it would
pip-installed ones. Plugin modules leave marker files when imported or called,
which is how a test sees that a module was never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm.config import EngineConfig, ModelConfig, SchedulerConfig
from actorlm.gpu.platforms import CpuPlatform, CudaPlatform, Platform

from .distbuilder import run_python, write_distribution

BUILTIN = "cuda" if torch.cuda.is_available() else "cpu"

MARK = """
import os
from pathlib import Path


def mark(tag):
    # Appends, so a test can count how often something ran.
    with open(Path(os.environ["MARKER_DIR"], tag), "a") as f:
        f.write("x")
"""

DRIVER = """
import dataclasses, json, os
from actorlm.extensions import plugins
from actorlm.extensions.hooks import HookRegistry
from actorlm.extensions.points import EVICTION_POLICIES, PLATFORMS
from actorlm.gpu.platforms import CpuPlatform

out = {}
try:
    report = plugins.load_plugins()
    out["idempotent"] = plugins.load_plugins() is report
    platform = plugins.current_platform()
    out["platform_class"] = type(platform).__qualname__
    out["platform_cached"] = platform is plugins.current_platform()
except plugins.PlatformError as exc:
    report = exc.report
    out["platform_exc"] = str(exc)
    try:
        plugins.load_plugins()
    except plugins.PlatformError as again:
        out["raises_again"] = str(again) == str(exc)
out["report"] = dataclasses.asdict(report)
out["markers"] = {m: len(open(os.path.join(os.environ["MARKER_DIR"], m)).read())
                  for m in os.listdir(os.environ["MARKER_DIR"])}
out["eviction_sources"] = {e.name: e.source for e in EVICTION_POLICIES}
out["platform_sources"] = {e.name: e.source for e in PLATFORMS}
out["hooks"] = [dataclasses.asdict(h) for h in HookRegistry.hooks()]
out["attention"] = CpuPlatform().default_attention_backend()
print(json.dumps(out))
"""


def platform_dist(site: Path, dist: str, pkg: str, ep: str, present_var: str) -> None:
    """A platform plugin whose hardware is 'present' when ``present_var`` is set,
    shipping a sibling general plugin ``<ep>_extras`` in the same distribution."""
    write_distribution(
        site,
        dist,
        {
            f"{pkg}/__init__.py": f"""
                import os
                from ._mark import mark

                mark("{pkg}.imported")


                def activate():
                    mark("{ep}.activated")
                    return "{pkg}.platform.Platform" if os.environ.get("{present_var}") else None
            """,
            f"{pkg}/_mark.py": MARK,
            f"{pkg}/platform.py": f"""
                from actorlm.gpu.platforms import CpuPlatform


                class Platform(CpuPlatform):
                    name = "{ep}"
            """,
            f"{pkg}/extras.py": f"""
                from ._mark import mark

                mark("{pkg}.extras.imported")


                def register():
                    mark("{ep}_extras.registered")
            """,
        },
        {
            "actorlm.platforms": {ep: f"{pkg}:activate"},
            "actorlm.plugins": {f"{ep}_extras": f"{pkg}.extras:register"},
        },
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    write_distribution(
        site,
        "alpha-plugin",
        {
            "alpha_plugin/__init__.py": """
                from actorlm.extensions.hooks import HookType, plugin_hook
                from actorlm.extensions.points import EVICTION_POLICIES
                from ._mark import mark


                def register():
                    from actorlm.actors.cache.eviction import LRUStrategy

                    mark("alpha.registered")
                    EVICTION_POLICIES.register("alpha-lru", type("AlphaLRU", (LRUStrategy,), {}))
                    plugin_hook(
                        "actorlm.gpu.platforms.CpuPlatform.default_attention_backend",
                        type=HookType.AFTER,
                    )(lambda result, self: "alpha-" + result)
            """,
            "alpha_plugin/_mark.py": MARK,
        },
        {"actorlm.plugins": {"alpha": "alpha_plugin:register"}},
    )
    write_distribution(
        site,
        "beta-plugin",
        {
            "beta_plugin.py": MARK + "\n\ndef register():\n    mark('beta.registered')\n",
        },
        {"actorlm.plugins": {"beta": "beta_plugin:register"}},
    )
    write_distribution(
        site,
        "broken-plugin",
        {"broken_plugin.py": "raise ImportError('needs libfoo')\n"},
        {"actorlm.plugins": {"broken": "broken_plugin:register"}},
    )
    platform_dist(site, "acme-platform", "acme_platform", "acme", "ACME_PRESENT")
    platform_dist(site, "zeta-platform", "zeta_platform", "zeta", "ZETA_PRESENT")
    return site


def load(site: Path, tmp_path: Path, **env: str) -> dict[str, Any]:
    markers = tmp_path / "markers"
    markers.mkdir()
    proc = run_python(["-c", DRIVER], [site], {"MARKER_DIR": str(markers), **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def statuses(out: dict[str, Any], kind: str = "plugins") -> dict[str, str]:
    return {p["name"]: p["status"] for p in out["report"][kind]}


def test_all_plugins_load_by_default_and_a_broken_one_is_reported(
    site: Path, tmp_path: Path
) -> None:
    out = load(site, tmp_path)
    assert statuses(out) == {
        "alpha": "loaded",
        "beta": "loaded",
        "broken": "failed",
        "acme_extras": "skipped",
        "zeta_extras": "skipped",
    }
    broken = next(p for p in out["report"]["plugins"] if p["name"] == "broken")
    assert broken["dist"] == "broken-plugin" and "needs libfoo" in broken["error"]
    assert any("'broken'" in e and "broken-plugin" in e for e in out["report"]["errors"])
    # No platform hardware present: both activate() ran, neither was chosen.
    assert statuses(out, "platforms") == {"acme": "inactive", "zeta": "inactive"}
    assert out["report"]["platform"] == BUILTIN and out["platform_class"].lower() == (
        BUILTIN + "platform"
    )
    assert out["idempotent"] and out["platform_cached"]
    # Siblings of unchosen platforms were skipped without being imported.
    assert "acme_platform.extras.imported" not in out["markers"]
    assert "zeta_platform.extras.imported" not in out["markers"]
    assert out["markers"]["alpha.registered"] == 1 and out["markers"]["beta.registered"] == 1


def test_registrations_and_hooks_are_attributed_and_applied(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path)
    assert out["eviction_sources"]["alpha-lru"] == "alpha"
    assert out["platform_sources"]["cpu"] == "builtin"
    assert out["hooks"] == [
        {
            "target": "actorlm.gpu.platforms.CpuPlatform.default_attention_backend",
            "type": "after",
            "source": "alpha",
            "fn": "alpha_plugin.register.<locals>.<lambda>",
            "status": "applied",
        }
    ]
    assert out["attention"] == "alpha-cpu"


def test_empty_allowlist_loads_nothing(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLUGINS="", ACME_PRESENT="1")
    assert set(statuses(out).values()) == {"not allowed"}
    assert set(statuses(out, "platforms").values()) == {"not allowed"}
    assert out["report"]["platform"] == BUILTIN
    assert out["markers"] == {} and out["hooks"] == [] and out["report"]["allowlist"] == []


def test_allowlist_selects_by_name_and_flags_unknown_names(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLUGINS=" beta, acme,acme_extras,nosuch", ACME_PRESENT="1")
    assert statuses(out) == {
        "alpha": "not allowed",
        "beta": "loaded",
        "broken": "not allowed",
        "acme_extras": "loaded",
        "zeta_extras": "not allowed",
    }
    assert statuses(out, "platforms") == {"acme": "active", "zeta": "not allowed"}
    assert out["report"]["platform"] == "acme" and out["platform_class"] == "Platform"
    assert "zeta_platform.imported" not in out["markers"]
    assert out["report"]["errors"] == [
        "ACTORLM_PLUGINS names 'nosuch', which no installed plugin provides"
    ]


def test_one_active_platform_is_chosen_and_its_siblings_load(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ZETA_PRESENT="1")
    assert out["report"]["platform"] == "zeta" and out["platform_sources"]["zeta"] == "zeta"
    assert statuses(out, "platforms") == {"acme": "inactive", "zeta": "active"}
    assert statuses(out)["zeta_extras"] == "loaded" and statuses(out)["acme_extras"] == "skipped"
    assert "acme_platform.extras.imported" not in out["markers"]


def test_several_active_platforms_are_an_error_naming_them(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACME_PRESENT="1", ZETA_PRESENT="1")
    assert "acme, zeta" in out["platform_exc"] and "ACTORLM_PLATFORM" in out["platform_exc"]
    assert out["raises_again"] and out["report"]["platform"] == ""
    # General plugins still loaded, so `actorlm plugins` can show everything.
    assert statuses(out)["alpha"] == "loaded"


def test_platform_env_considers_only_that_platform(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLATFORM="acme", ACME_PRESENT="1", ZETA_PRESENT="1")
    assert out["report"]["platform"] == "acme"
    assert statuses(out, "platforms") == {"acme": "active", "zeta": "not selected"}
    assert "zeta_platform.imported" not in out["markers"]  # never even imported
    assert statuses(out)["zeta_extras"] == "skipped" and statuses(out)["acme_extras"] == "loaded"


def test_platform_env_unknown_name_lists_the_discovered(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLATFORM="tpu")
    assert "'tpu'" in out["platform_exc"] and "acme, cpu, cuda, zeta" in out["platform_exc"]
    assert "acme_platform.imported" not in out["markers"]


def test_platform_env_with_absent_hardware_is_an_error(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLATFORM="acme")
    assert "returned None" in out["platform_exc"] and "not available" in out["platform_exc"]
    assert out["markers"]["acme.activated"] == 1


def test_platform_env_can_name_a_builtin(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLATFORM="cpu", ACME_PRESENT="1")
    assert out["report"]["platform"] == "cpu" and out["platform_class"] == "CpuPlatform"
    assert "acme_platform.imported" not in out["markers"]
    assert statuses(out)["acme_extras"] == "skipped"


def test_cpu_platform_describes_this_machine() -> None:
    platform = CpuPlatform()
    assert platform.total_memory() > platform.memory_usage() > 0
    assert platform.device_name() and platform.torch_device() == torch.device("cpu")
    assert platform.default_attention_backend() == "cpu" and not platform.supports_graphs()
    assert platform.distributed_backend == "gloo"
    assert platform.kv_pool_class == "actorlm.gpu.kv_pool:KVPool"
    unset = EngineConfig(model=ModelConfig(device="", attention_backend="", page_size=0))
    model = platform.adjust_defaults(unset).model
    assert (model.device, model.attention_backend, model.page_size) == ("cpu", "cpu", 16)
    assert model.dtype == platform.default_dtype()  # auto
    # the GGUF's blocks, on int8 rows where those are the CPU's fastest arithmetic
    assert model.quantization == ("gguf_a8" if platform.int8_rows_fastest() else "gguf")
    cores = len(os.sched_getaffinity(0))
    budget = platform.adjust_defaults(unset).scheduler.max_prefill_tokens
    base = min(2048, max(256, 128 * cores))  # ~0.5 s of fp32 prefill a step
    amx = model.dtype == "bfloat16" and "amx_bf16" in platform.native_bf16()
    assert budget == (2 * base if amx else base)  # AMX's bf16 prefill takes twice the tokens
    fp32 = EngineConfig(model=ModelConfig(device="", dtype="float32", page_size=0))
    assert platform.adjust_defaults(fp32).scheduler.max_prefill_tokens == base
    # a decode's pages in runs of 8 on a CPU (its prefetcher), one at a time elsewhere
    assert platform.adjust_defaults(unset).scheduler.decode_page_run == 8
    assert Platform().adjust_defaults(unset).scheduler.decode_page_run == 1
    chosen = EngineConfig(
        model=ModelConfig(
            device="cpu", dtype="float32", attention_backend="x", page_size=4, quantization="none"
        ),
        scheduler=SchedulerConfig(max_prefill_tokens=4096, decode_page_run=2),
    )
    assert platform.adjust_defaults(chosen) is chosen  # what the user chose stays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_platform_on_a_gpu() -> None:
    platform = CudaPlatform()
    assert CudaPlatform.is_available() and platform.supports_graphs()
    before = platform.memory_usage()
    block = torch.empty(1 << 20, device=platform.torch_device())  # 4 MiB
    assert platform.memory_usage() - before >= block.numel() * 4
    assert platform.total_memory() > platform.memory_usage()
    assert platform.device_name() and platform.distributed_backend == "nccl"
    # triton where it imports, then flashinfer, then the torch backend
    want = next((m for m in ("triton", "flashinfer") if importlib.util.find_spec(m)), "torch")
    assert platform.default_attention_backend() == want


@pytest.mark.skipif(BUILTIN == "cuda", reason="checks a machine without CUDA")
def test_platform_env_naming_cuda_without_a_gpu_is_an_error(site: Path, tmp_path: Path) -> None:
    out = load(site, tmp_path, ACTORLM_PLATFORM="cuda")
    assert "'cuda'" in out["platform_exc"] and "not available" in out["platform_exc"]
