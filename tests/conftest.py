from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models import (
    build_family_model,
    build_tiny_model,
    default_gguf_path,
    smollm2_tokenizer_dir,
)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_gguf_path()


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
