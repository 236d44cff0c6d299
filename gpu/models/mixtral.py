"""Mixtral: Llama's attention (with Mistral's window when a config sets one) and a
``SparseMoE`` in every layer, top-2 of 8 renormalized. HF names the MoE block
``block_sparse_moe`` and an expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from torch import nn

from .layers import Attention
from .llama import DecoderLayer, LlamaForCausalLM
from .moe import SparseMoE

__all__ = ["MixtralForCausalLM"]

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        info = self.info
        moe = SparseMoE(
            info.hidden_size,
            info.moe_intermediate_size or info.intermediate_size,
            info.num_experts,
            info.num_experts_per_tok,
            renormalize=True,
        )
        return DecoderLayer(info, Attention(info, layer), moe)

    def rename(self, name: str) -> str | None:
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if "experts" in parts:
            parts = [_EXPERT_NAMES.get(p, p) for p in parts]
        return ".".join(parts)
