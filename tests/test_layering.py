"""The module map's dependency rules (README, "Module map"), checked on every import
statement of the package, the ones inside functions included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ENTRY_POINTS = {
    "actorlm.cli",
    "actorlm.engine",
    "actorlm.launch",
    "actorlm.schema",
    "actorlm.report",
    "actorlm.serve",
    "actorlm.testing",  # the pytest plugin: an Engine and any actor, for plugins' tests
}
# Pure cores: plain Python over message structs, testable without processes or tensors.
PURE_CORES = {
    "actorlm.actors.scheduler.policy",
    "actorlm.actors.cache.allocator",
    "actorlm.actors.cache.blocks",
    "actorlm.actors.cache.eviction",
    "actorlm.actors.cache.hicache",
    "actorlm.actors.cache.kv_cache",
    "actorlm.actors.cache.radix",
    "actorlm.actors.cache.step",
    "actorlm.actors.lora_loader.eviction",
    "actorlm.actors.lora_loader.peft",
    "actorlm.actors.lora_loader.registry",
    "actorlm.actors.lora_loader.slots",
    "actorlm.actors.scheduler.adapters",
    "actorlm.actors.replicas",
    "actorlm.actors.router.core",
    "actorlm.actors.router.policies",
    "actorlm.actors.tokenizer.detokenize",
    "actorlm.actors.tokenizer.tokenization",
}
IMPURE = ("asyncio", "zmq", "torch", "aiohttp", "uvloop", "actorlm.actors.runtime")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["actorlm", *parts])


def imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports at run time, as absolute names (``from x import y``
    gives both ``x`` and ``x.y``, since ``y`` may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(source)
    typing_only = {  # `if TYPE_CHECKING:` blocks: names for type checkers, no run-time coupling
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _under(name: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(module: str, imported: set[str]) -> list[str]:
    """The rules of the module map broken by ``module`` importing ``imported``."""
    out = []
    entry = _under(module, ENTRY_POINTS) or module == "actorlm"
    gateway = _under(module, ("actorlm.gateway",))
    for name in sorted(imported):
        if not entry and _under(name, ENTRY_POINTS):
            out.append(f"{module} imports {name}: only entry points import entry points")
        if not (entry or gateway) and _under(name, ("actorlm.gateway",)):
            out.append(f"{module} imports {name}: only entry points sit above the gateway")
        if _under(module, ("actorlm.gpu",)) and _under(name, ("actorlm.actors",)):
            out.append(f"{module} imports {name}: gpu/ imports nothing of actors/")
        if (
            _under(module, ("actorlm.messages",))
            and name.startswith("actorlm.")
            and not _under(name, ("actorlm.messages",))
        ):
            out.append(f"{module} imports {name}: messages/ imports nothing above it")
        if _under(module, ("actorlm.extensions", "actorlm.config")) and _under(
            name, ("actorlm.actors", "actorlm.gpu")
        ):
            out.append(
                f"{module} imports {name}: extensions/ and config sit below actors/ and gpu/"
            )
        if _under(module, ("actorlm.gateway",)) and _under(name, ("torch", "actorlm.gpu")):
            out.append(f"{module} imports {name}: the gateway never imports torch")
        if module in PURE_CORES and _under(name, IMPURE):
            out.append(f"{module} imports {name}: a pure core imports no asyncio, zmq or torch")
    return out


def package_modules() -> list[Path]:
    skip = {"tests", "bench", "scripts", "docs", ".venv", "build"}
    return [
        p
        for p in ROOT.rglob("*.py")
        if not (set(p.relative_to(ROOT).parts[:-1]) & skip) and "egg-info" not in str(p)
    ]


def test_every_module_follows_the_layering() -> None:
    broken = []
    for path in package_modules():
        module = module_name(path)
        found = imports(path.read_text(), module, path.name == "__init__.py")
        broken += violations(module, found)
    assert broken == []


def test_every_pure_core_exists() -> None:
    names = {module_name(p) for p in package_modules()}
    assert names >= PURE_CORES


@pytest.mark.parametrize(
    ("module", "source", "rule"),
    [
        ("actorlm.gpu.runner", "from ..actors.client import ClientActor", "gpu/ imports nothing"),
        ("actorlm.actors.cli2", "from ..gateway import app", "only entry points"),
        ("actorlm.actors.scheduler.policy", "import asyncio", "pure core"),
        ("actorlm.actors.cache.radix", "def f():\n    import torch", "pure core"),
        ("actorlm.messages.step", "from ..config import EngineConfig", "messages/ imports"),
        ("actorlm.gateway.params", "from ..gpu.sampling import Sampler", "never imports torch"),
        ("actorlm.gateway.app", "from ..cli import main", "only entry points import"),
    ],
)
def test_a_wrong_import_is_caught(module: str, source: str, rule: str) -> None:
    found = imports(source, module, is_package=False)
    assert any(rule in v for v in violations(module, found))


def test_the_gateway_process_loads_no_torch() -> None:
    code = (
        "import sys, importlib, pkgutil, actorlm.gateway as g\n"
        "for m in pkgutil.iter_modules(g.__path__): importlib.import_module(f'actorlm.gateway.{m.name}')\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
