"""Every extension point's registry, named once.

Import the registry you extend from here::

    from actorlm.extensions.points import EVICTION_POLICIES
    EVICTION_POLICIES.register("my-policy", MyPolicy)

Built-ins register themselves in the module that defines them (or lazily by
dotted path), through this same API. Each registry names the interface its entries
implement; a plugin's entry that does not is refused when it is registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import Registry, get_registry

if TYPE_CHECKING:  # the interfaces, for type checkers; at run time they load by path
    from torch import nn

    from ..actors.cache.eviction import EvictionStrategy
    from ..actors.cache.hicache import HiCacheStorage
    from ..actors.lora_loader.eviction import EvictionPolicy
    from ..actors.router.policies import RouterPolicy
    from ..actors.tokenizer.reasoning import ReasoningFormat
    from ..gpu.attention.base import AttentionBackend
    from ..gpu.grammar.base import BaseGrammarBackend
    from ..gpu.loaders.base import WeightLoader
    from ..gpu.logit_processors import LogitProcessor
    from ..gpu.platforms import Platform
    from ..gpu.quantization import LinearMethod

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
    "REASONING_PARSERS",
    "ROUTER_POLICIES",
    "WEIGHT_LOADERS",
    "load_builtins",
]

MODELS: Registry[type[nn.Module]] = get_registry(
    "model architecture", "config.json architectures", interface="torch.nn:Module"
)
ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = get_registry(
    "attention backend",
    "--attention-backend",
    interface="actorlm.gpu.attention.base:AttentionBackend",
)
WEIGHT_LOADERS: Registry[type[WeightLoader]] = get_registry(
    "weight loader", "--load-format", interface="actorlm.gpu.loaders.base:WeightLoader"
)
# One compiles every constrained request in the worker (--grammar-fallback names the
# next one to try).
GRAMMAR_BACKENDS: Registry[type[BaseGrammarBackend]] = get_registry(
    "grammar backend",
    "--grammar-backend",
    interface="actorlm.gpu.grammar.base:BaseGrammarBackend",
)
# ReasoningFormat values (not classes): where a model's thinking starts and ends.
REASONING_PARSERS: Registry[ReasoningFormat] = get_registry(
    "reasoning parser", "--reasoning-parser"
)
EVICTION_POLICIES: Registry[type[EvictionStrategy]] = get_registry(
    "KV eviction policy",
    "--eviction-policy",
    interface="actorlm.actors.cache.eviction:EvictionStrategy",
)
HICACHE_STORAGE: Registry[type[HiCacheStorage]] = get_registry(
    "HiCache storage backend",
    "--hicache-storage-backend",
    interface="actorlm.actors.cache.hicache:HiCacheStorage",
)
# Which worker slot an adapter that needs one takes (in the lora_loader).
LORA_EVICTION_POLICIES: Registry[type[EvictionPolicy]] = get_registry(
    "LoRA eviction policy",
    "--lora-eviction-policy",
    interface="actorlm.actors.lora_loader.eviction:EvictionPolicy",
)
# Which data-parallel replica takes a request (in the tokenizer's router).
ROUTER_POLICIES: Registry[type[RouterPolicy]] = get_registry(
    "router policy", "--router-policy", interface="actorlm.actors.router.policies:RouterPolicy"
)
LOGIT_PROCESSORS: Registry[type[LogitProcessor]] = get_registry(
    "logit processor",
    "sampling_params.logit_processors",
    interface="actorlm.gpu.logit_processors:LogitProcessor",
)
PLATFORMS: Registry[type[Platform]] = get_registry(
    "platform", "ACTORLM_PLATFORM", interface="actorlm.gpu.platforms:Platform"
)
QUANTIZATION_METHODS: Registry[type[LinearMethod]] = get_registry(
    "quantization method", "--quantization", interface="actorlm.gpu.quantization:LinearMethod"
)

# Modules whose import registers the built-in entries of the registries above.
BUILTIN_MODULES = (
    "actorlm.gpu.models",
    "actorlm.gpu.loaders",
    "actorlm.gpu.attention",
    "actorlm.gpu.logit_processors",
    "actorlm.gpu.platforms",
    "actorlm.gpu.quantization",
    "actorlm.gpu.grammar",
    "actorlm.actors.cache.eviction",
    "actorlm.actors.cache.hicache",
    "actorlm.actors.tokenizer.reasoning",
    "actorlm.actors.lora_loader.eviction",
    "actorlm.actors.router.policies",
    "actorlm.actors.roles",
)


def load_builtins() -> None:
    """Import every built-in extension so the registries are complete (``actorlm plugins``)."""
    import importlib

    for name in BUILTIN_MODULES:
        importlib.import_module(name)
