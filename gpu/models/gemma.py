"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm by
``1 + weight``, tanh-GELU gated MLPs, a norm after attention and after the MLP as
well as before each, softmax scale ``query_pre_attn_scalar ** -0.5``, and layers
alternating between a sliding window and full attention.

Gemma 2 also soft-caps attention scores (the backend, told by the step's
metadata) and the final logits (``CausalLM.forward``). Gemma 3 instead norms q
and k per head, and its windowed layers use their own RoPE base.
"""

from __future__ import annotations

import msgspec
import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..model_info import ModelInfo
from .base import CausalLM
from .layers import Attention, GatedMLP, GemmaRMSNorm
from .rope import Rope

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, info: ModelInfo, attn: Attention) -> None:
        super().__init__()
        hidden, eps = info.hidden_size, info.rms_norm_eps
        self.self_attn = attn
        self.mlp = GatedMLP(hidden, info.intermediate_size, info.hidden_act)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: ForwardMeta,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (this layer's output, the running sum before it), as in Llama."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rotary, meta, backend))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(CausalLM):
    norm_class = GemmaRMSNorm
    activations = ("gelu_pytorch_tanh", "gelu")  # old configs say gelu and mean the tanh one
    qk_norm: type[GemmaRMSNorm] | None = None

    def __init__(self, info: ModelInfo, max_model_len: int | None = None) -> None:
        if info.hidden_act == "gelu":
            info = msgspec.structs.replace(info, hidden_act="gelu_pytorch_tanh")
        super().__init__(info, max_model_len)
        self.embed_scale = info.hidden_size**0.5

    def make_layer(self, layer: int) -> nn.Module:
        return GemmaDecoderLayer(self.info, Attention(self.info, layer, qk_norm=self.qk_norm))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # the scale rounded to the weights' dtype first, as transformers does
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = GemmaRMSNorm

    def make_ropes(self) -> list[Rope]:
        """[full layers' RoPE, windowed layers' RoPE] (Gemma 3's local base is 10k)."""
        info = self.info
        full = super().make_ropes()
        theta = info.sliding_rope_theta or info.rope_theta
        local = Rope(
            info.head_dim,
            theta,
            self.max_len,
            info.sliding_rope_scaling,
            info.max_position_embeddings,
        )
        return [*full, local]

    def rope_of(self, layer: int) -> int:
        return 1 if self.info.window(layer) else 0


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (4B and up), text only:
    its tensors sit under ``language_model`` and the vision tower's are skipped."""

    def rename(self, name: str) -> str | None:
        if "vision_tower" in name or "multi_modal_projector" in name:
            return None
        for prefix, ours in (
            ("model.language_model.", "model."),  # transformers 5
            ("language_model.model.", "model."),  # 4.x checkpoints
            ("language_model.lm_head.", "lm_head."),
        ):
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return name
