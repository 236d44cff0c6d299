"""Model architectures, registered lazily by HF ``architectures`` name (no torch import here)."""

from actorlm.extensions.points import MODELS

__all__: list[str] = []

for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    MODELS.register_builtin(_arch, "actorlm.gpu.models.llama:LlamaForCausalLM")
