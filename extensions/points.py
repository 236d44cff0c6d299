"""Every extension point's registry, named once.

Import the registry you extend from here::

    from actorlm.extensions.points import EVICTION_POLICIES
    EVICTION_POLICIES.register("my-policy", MyPolicy)

Built-ins register themselves in the module that defines them (or lazily by
dotted path), through this same API.
"""

from __future__ import annotations

from typing import Any

from .registry import Registry, get_registry

__all__ = [
    "ATTENTION_BACKENDS",
    "EVICTION_POLICIES",
    "GRAMMAR_BACKENDS",
    "HICACHE_STORAGE",
    "LOGIT_PROCESSORS",
    "LORA_EVICTION_POLICIES",
    "MODELS",
    "PLATFORMS",
    "QUANTIZATION_METHODS",
    "WEIGHT_LOADERS",
    "load_builtins",
]

MODELS: Registry[Any] = get_registry("model architecture", "config.json architectures")
ATTENTION_BACKENDS: Registry[Any] = get_registry("attention backend", "--attention-backend")
WEIGHT_LOADERS: Registry[Any] = get_registry("weight loader", "--load-format")
# Declared for plugins to fill, but no part of the engine reads them yet: no flag selects
# from them until structured output and the LoRA loader land.
GRAMMAR_BACKENDS: Registry[Any] = get_registry(
    "grammar backend", unused="structured output is not built yet"
)
EVICTION_POLICIES: Registry[Any] = get_registry("KV eviction policy", "--eviction-policy")
HICACHE_STORAGE: Registry[Any] = get_registry(
    "HiCache storage backend", "--hicache-storage-backend"
)
LORA_EVICTION_POLICIES: Registry[Any] = get_registry(
    "LoRA eviction policy", "--lora-eviction-policy"
)
LOGIT_PROCESSORS: Registry[Any] = get_registry(
    "logit processor", "sampling_params.logit_processors"
)
PLATFORMS: Registry[Any] = get_registry("platform", "ACTORLM_PLATFORM")
QUANTIZATION_METHODS: Registry[Any] = get_registry("quantization method", "--quantization")

# Modules whose import registers the built-in entries of the registries above.
BUILTIN_MODULES = (
    "actorlm.gpu.models",
    "actorlm.gpu.loaders",
    "actorlm.gpu.attention",
    "actorlm.gpu.logit_processors",
    "actorlm.gpu.platforms",
    "actorlm.gpu.quantization",
    "actorlm.actors.cache.eviction",
    "actorlm.actors.cache.hicache",
    "actorlm.actors.lora_loader.eviction",
    "actorlm.actors.roles",
)


def load_builtins() -> None:
    """Import every built-in extension so the registries are complete (``actorlm plugins``)."""
    import importlib

    for name in BUILTIN_MODULES:
        importlib.import_module(name)
