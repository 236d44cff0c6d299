from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.models import (
    build_family_model,
    build_lora_adapter,
    build_tiny_model,
    default_gguf_path,
    smollm2_tokenizer_dir,
)


# actorlm.testing's fixtures (actorlm_harness, ...) come by its pytest11 entry point; an
# install whose metadata predates it (or autoloading turned off) gets them from here.
def pytest_configure(config: pytest.Config) -> None:
    import actorlm.testing

    if not config.pluginmanager.is_registered(actorlm.testing):
        config.pluginmanager.register(actorlm.testing, "actorlm")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_gguf_transformers(default_gguf: Path) -> Any:
    """transformers' fp32 model of the default GGUF, loaded once: dequantizing the file
    takes ~20 s, and the reference tests of gguf and bf16 both read it (neither mutates it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype="float32"
    ).eval()


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch="llama", **config_overrides)`` → a saved tiny model folder, built once per args."""
    built: dict[str, Path] = {}

    def factory(arch: str = "llama", **overrides: object) -> Path:
        key = f"{arch}-{sorted(overrides.items())}"
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = build_tiny_model(out, arch, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def family_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(name, **config_overrides)`` → a saved tiny model of ``FAMILIES[name]``
    (its tokenizer and chat template included), built once per args."""
    built: dict[str, Path] = {}

    def factory(name: str, **overrides: object) -> Path:
        key = f"{name}-{sorted(overrides.items())}"
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{name}")
            built[key] = build_family_model(out, name, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


# Random PEFT adapters for ``tiny_llama``: ranks, targets and PEFT options that differ.
LORA_ADAPTERS: dict[str, dict[str, object]] = {
    "sql": {"r": 4, "alpha": 8, "targets": ("q_proj", "v_proj", "down_proj"), "seed": 1},
    "chat": {
        "r": 8,
        "alpha": 16,
        "targets": ("k_proj", "o_proj", "gate_proj", "up_proj"),
        "seed": 2,
    },
    "all": {
        "r": 16,
        "alpha": 16,
        "targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "seed": 3,
        "use_rslora": True,
        "scale": 0.5,
    },
    # another rank for up_proj, and only the second layer adapted
    "sparse": {
        "r": 6,
        "alpha": 12,
        "targets": ("q_proj", "up_proj"),
        "seed": 4,
        "rank_pattern": {"up_proj": 3},
        "layers_to_transform": [1],
    },
}


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name → a PEFT adapter folder (saved by ``peft``) for ``tiny_llama``."""
    root = tmp_path_factory.mktemp("lora")
    return {
        name: build_lora_adapter(tiny_llama, root / name, **spec)  # type: ignore[arg-type]
        for name, spec in LORA_ADAPTERS.items()
    }
