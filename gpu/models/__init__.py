"""Model architectures, registered lazily by HF ``architectures`` name (no torch import here).

Any architecture not registered here runs through the transformers fallback
(``--model-impl transformers``, or ``auto``: ``actorlm.gpu.models.hf_fallback``).
"""

from actorlm.extensions.points import MODELS

__all__ = ["NATIVE_ARCHITECTURES"]

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
}

for _arch, (_target, _family) in NATIVE_ARCHITECTURES.items():
    MODELS.register_builtin(_arch, f"actorlm.gpu.models.{_target}", help=f"native: {_family}")
