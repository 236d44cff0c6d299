"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Phi-3 with its
fused checkpoint and LongRoPE) over a ragged, paged batch.

Only the rows that need sampling reach the LM head (a prefill of 512 tokens
computes one logits row). Parameter names follow HF's; q/k/v and gate/up are
fused into one matmul each, and ``load_weight`` routes HF's separate tensors into
their shard.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..model_info import ModelInfo
from .base import CausalLM
from .layers import Attention, GatedMLP, RMSNorm

__all__ = ["DecoderLayer", "LlamaForCausalLM"]


class DecoderLayer(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp`` may be an MoE."""

    def __init__(self, info: ModelInfo, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: ForwardMeta,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's output, the running sum before it): the sum
        and the next norm fuse into one pass (``ops.fused_add_rms_norm``)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, layer: int) -> nn.Module:
        info = self.info
        mlp = GatedMLP(info.hidden_size, info.intermediate_size, info.hidden_act)
        return DecoderLayer(info, Attention(info, layer), mlp)
