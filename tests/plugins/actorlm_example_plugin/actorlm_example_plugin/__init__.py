"""An actorlm plugin with one example of every extension point.

``register()`` runs once in every actor process before the actor starts, and
only registers. Implementations are named by dotted path and imported where
they are used (the model only in the worker). Hooks are the exception: applying
them imports their targets, here the worker's sampler (torch), in every process.
"""

from __future__ import annotations

from actorlm.extensions.points import (
    ATTENTION_BACKENDS,
    EVICTION_POLICIES,
    HICACHE_STORAGE,
    LOGIT_PROCESSORS,
    LORA_EVICTION_POLICIES,
    MODELS,
    WEIGHT_LOADERS,
)

__all__ = ["register"]

_PKG = "actorlm_example_plugin"


def register() -> None:
    # Hooks and interceptors register themselves when their module is imported.
    from . import hooks, interceptors  # noqa: F401

    MODELS.register(
        "ExampleLlamaForCausalLM",
        f"{_PKG}.model:ExampleLlamaForCausalLM",
        help="the built-in Llama under a new architecture name",
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
