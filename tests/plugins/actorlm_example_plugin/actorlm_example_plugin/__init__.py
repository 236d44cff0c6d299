"""An actorlm plugin with one example of every extension point.

``register(settings)`` runs once in every actor process before the actor starts,
and only registers. Implementations are named by dotted path and imported where
they are used (the model only in the worker). Hooks are the exception: applying
them imports their targets, here the worker's sampler (torch), in every process.
``settings`` are this plugin's ``--plugin-config example.KEY=VALUE`` values.
"""

from __future__ import annotations

from actorlm.extensions.points import (
    ATTENTION_BACKENDS,
    EVICTION_POLICIES,
    GRAMMAR_BACKENDS,
    HICACHE_STORAGE,
    LOGIT_PROCESSORS,
    LORA_EVICTION_POLICIES,
    MODELS,
    ROUTER_POLICIES,
    WEIGHT_LOADERS,
)
from actorlm.extensions.settings import PluginSettings

from .record import record

__all__ = ["REQUIRES_API", "register"]

REQUIRES_API = 1  # the plugin API this was written for (actorlm.extensions.API_VERSION)

_PKG = "actorlm_example_plugin"


def register(settings: PluginSettings) -> None:
    # Hooks and interceptors register themselves when their module is imported.
    from . import hooks, interceptors  # noqa: F401

    greeting = settings.get_str("greeting", "")
    if greeting:
        record(f"settings.greeting={greeting}")

    MODELS.register(
        "ExampleLlamaForCausalLM",
        f"{_PKG}.model:ExampleLlamaForCausalLM",
        help="the built-in Llama under a new architecture name",
    )
    MODELS.register(
        "Qwen2MoeForCausalLM",
        f"{_PKG}.moe:Qwen2MoeForCausalLM",
        help="Qwen2-MoE, from actorlm's MoE layer",
    )
    ATTENTION_BACKENDS.register(
        "example_counting",
        f"{_PKG}.attention:CountingTorchBackend",
        help="the torch backend, counting steps",
    )
    WEIGHT_LOADERS.register(
        "example_safetensors",
        f"{_PKG}.loader:RecordingSafetensorsLoader",
        help="safetensors, recording what it loads",
    )
    EVICTION_POLICIES.register(
        "example_oldest_first",
        f"{_PKG}.eviction:OldestFirst",
        help="evict the oldest pages first",
    )
    HICACHE_STORAGE.register(
        "example_recording",
        f"{_PKG}.storage:RecordingFileStorage",
        help="the file backend, recording reads and writes",
    )
    LORA_EVICTION_POLICIES.register(
        "example_most_used_first",
        f"{_PKG}.lora_eviction:MostUsedFirst",
        help="evict the adapter used most",
    )
    LOGIT_PROCESSORS.register(
        "example_force_token",
        f"{_PKG}.logits:ForceToken",
        help="always sample params['token_id']",
    )
    GRAMMAR_BACKENDS.register(
        "example_recording_grammar",
        f"{_PKG}.grammar:RecordingGrammarBackend",
        help="xgrammar, recording each compile",
    )
    ROUTER_POLICIES.register(
        "example_last_replica",
        f"{_PKG}.router:LastReplica",
        help="every request to the last replica up",
    )
