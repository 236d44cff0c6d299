"""Qwen3 (Llama's layout with per-head RMSNorm on q and k, no qkv bias) and
Qwen3-MoE (the same attention, ``SparseMoE`` MLPs except in ``mlp_only_layers``)."""

from __future__ import annotations

from torch import nn

from .layers import Attention, GatedMLP, RMSNorm
from .llama import DecoderLayer, LlamaForCausalLM
from .moe import SparseMoE

__all__ = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        info = self.info
        attn = Attention(info, layer, qk_norm=RMSNorm)
        return DecoderLayer(info, attn, GatedMLP(info.hidden_size, info.intermediate_size))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        info = self.info
        attn = Attention(info, layer, qk_norm=RMSNorm)
        if not info.is_sparse(layer):
            return DecoderLayer(info, attn, GatedMLP(info.hidden_size, info.intermediate_size))
        moe = SparseMoE(
            info.hidden_size,
            info.moe_intermediate_size,
            info.num_experts,
            info.num_experts_per_tok,
            renormalize=info.norm_topk_prob,
        )
        return DecoderLayer(info, attn, moe)
