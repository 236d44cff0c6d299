"""Model architectures, registered lazily by HF ``architectures`` name (no torch import here).

Any architecture not registered here runs through the transformers fallback
(``--model-impl transformers``, or ``auto``: ``actorlm.gpu.models.hf_fallback``).
"""

from collections.abc import Sequence

from actorlm.extensions.points import MODELS

__all__ = ["MODEL_IMPLS", "NATIVE_ARCHITECTURES", "resolve_model_impl"]

# HF architecture → (module:class, the family it belongs to)
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama:LlamaForCausalLM", "Llama 2/3, SmolLM2"),
    "MistralForCausalLM": ("llama:LlamaForCausalLM", "Mistral (sliding window)"),
    "Qwen2ForCausalLM": ("llama:LlamaForCausalLM", "Qwen2 (qkv bias)"),
    "Phi3ForCausalLM": ("llama:LlamaForCausalLM", "Phi-3/Phi-4-mini (fused, LongRoPE)"),
    "Qwen3ForCausalLM": ("qwen3:Qwen3ForCausalLM", "Qwen3 (q/k norms)"),
    "Qwen3MoeForCausalLM": ("qwen3:Qwen3MoeForCausalLM", "Qwen3-MoE (SparseMoE)"),
    "MixtralForCausalLM": ("mixtral:MixtralForCausalLM", "Mixtral (SparseMoE top-2)"),
    "Gemma2ForCausalLM": ("gemma:Gemma2ForCausalLM", "Gemma 2 (soft caps, windows)"),
    "Gemma3ForCausalLM": ("gemma:Gemma3ForCausalLM", "Gemma 3 text (windows, local RoPE)"),
    "Gemma3ForConditionalGeneration": (
        "gemma:Gemma3ForConditionalGeneration",
        "Gemma 3 4B+ checkpoints, the text model",
    ),
}

for _arch, (_target, _family) in NATIVE_ARCHITECTURES.items():
    MODELS.register_builtin(_arch, f"actorlm.gpu.models.{_target}", help=f"native: {_family}")

MODEL_IMPLS = ("auto", "native", "transformers")

# Architectures the transformers fallback cannot run right, and why: refused at start-up
# rather than served wrong (hf_fallback also refuses any model with sinks it meets).
FALLBACK_UNSERVED = {
    "GptOssForCausalLM": "learned attention sinks, which actorlm's attention backends do not compute",
}


def resolve_model_impl(architecture: str, impl: str = "auto", gaps: Sequence[str] = ()) -> str:
    """``native`` or ``transformers`` for ``architecture`` under ``--model-impl impl``
    (a plugin's registration counts as native); ``gaps``: what the checkpoint has that
    the built-in native models do not build (``ModelInfo.native_gaps``)."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"unknown --model-impl {impl!r}; known: {', '.join(MODEL_IMPLS)}")
    builtin_gaps = list(gaps) if MODELS.entry_source(architecture) == "builtin" else []
    if impl == "auto":
        native = architecture in MODELS and not builtin_gaps
        impl = "native" if native else "transformers"
    if impl == "native" and architecture not in MODELS:
        raise ValueError(
            f"model architecture {architecture!r} has no native implementation (registered: "
            f"{', '.join(MODELS.names())}); run it with --model-impl transformers (or auto)"
        )
    if impl == "native" and builtin_gaps:
        raise ValueError(
            f"the native {architecture} does not build {' or '.join(builtin_gaps)}; run "
            "it with --model-impl transformers (or auto)"
        )
    if impl == "transformers" and architecture in FALLBACK_UNSERVED:
        raise ValueError(
            f"model architecture {architecture!r} has {FALLBACK_UNSERVED[architecture]}: "
            "it has no native model here, and the transformers fallback would serve it wrong"
        )
    return impl
