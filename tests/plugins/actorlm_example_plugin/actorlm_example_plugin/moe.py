"""A model reusing actorlm's MoE layer: config.json ``"architectures": ["Qwen2MoeForCausalLM"]``.

Qwen2-MoE is Qwen2's attention (q/k/v bias) with a mixture of experts whose tokens
also pass a shared expert, gated by a sigmoid. ``SparseMoE`` has all of it: the
routing (softmax, top-k, renormalized as the config says), the experts grouped by
expert over the step's tokens, the shared expert. Its module names are HF's
(``mlp.gate``, ``mlp.experts.{e}.gate_proj``, ``mlp.shared_expert_gate``), so the
checkpoint loads as it is; linear methods quantize the experts like any linear.
Its layers are Llama's with a MoE, shared expert and all, so the CPU's fused step
takes them through ``llama_spec``.
"""

from __future__ import annotations

from actorlm.gpu.fused_decode import llama_spec, register_spec
from actorlm.gpu.models.layers import Attention, GatedMLP
from actorlm.gpu.models.llama import DecoderLayer, LlamaForCausalLM
from actorlm.gpu.models.moe import SparseMoE
from torch import nn

__all__ = ["Qwen2MoeForCausalLM"]


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        info = self.info
        if info.is_sparse(layer):
            mlp: nn.Module = SparseMoE(
                info.hidden_size,
                info.moe_intermediate_size,
                info.num_experts,
                info.num_experts_per_tok,
                renormalize=info.norm_topk_prob,
                shared_intermediate=info.shared_expert_intermediate_size,
            )
        else:  # mlp_only_layers, or between sparse ones (decoder_sparse_step)
            mlp = GatedMLP(info.hidden_size, info.intermediate_size)
        return DecoderLayer(info, Attention(info, layer), mlp)


register_spec(Qwen2MoeForCausalLM, llama_spec)
