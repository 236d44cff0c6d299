"""Model architectures, registered lazily by HF ``architectures`` name (no torch import here).

Any architecture not registered here runs through the transformers fallback
(``--model-impl transformers``, or ``auto``: ``actorlm.gpu.models.hf_fallback``).
"""

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


def resolve_model_impl(architecture: str, impl: str = "auto") -> str:
    """``native`` or ``transformers`` for ``architecture`` under ``--model-impl impl``
    (a plugin's registration counts as native)."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"unknown --model-impl {impl!r}; known: {', '.join(MODEL_IMPLS)}")
    if impl == "auto":
        return "native" if architecture in MODELS else "transformers"
    if impl == "native" and architecture not in MODELS:
        raise ValueError(
            f"model architecture {architecture!r} has no native implementation (registered: "
            f"{', '.join(MODELS.names())}); run it with --model-impl transformers (or auto)"
        )
    return impl
