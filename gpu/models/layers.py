"""Layers the native models share: norms, fused projections, attention over the
backend, gated MLPs. Tensors are packed rows [T, ...] of a ragged batch.

Fused projections (q|k|v, gate|up) are ``MergedLinear``: one ``nn.Linear`` whose
row blocks are named after the HF tensors they hold, so the loader can route a
checkpoint's separate tensors into their rows, and a fused checkpoint (Phi-3)
loads whole; linear methods convert it like any other ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..kernels import ops
from ..model_info import ModelInfo

__all__ = ["Attention", "GatedMLP", "GemmaRMSNorm", "MergedLinear", "RMSNorm", "rotate"]


class RMSNorm(nn.Module):
    """With a residual, SGLang's fused form: returns (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma scales by ``1 + weight``; the 1 is folded into the weight once it is loaded,
    so the forward is the fused kernel's."""

    def after_loading(self) -> None:
        self.weight.data.add_(1.0)


class MergedLinear(nn.Linear):
    """One matmul for HF projections stacked by rows, in ``shards`` order (name, rows)."""

    def __init__(self, in_features: int, shards: Sequence[tuple[str, int]], bias: bool) -> None:
        super().__init__(in_features, sum(n for _, n in shards), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, rows in shards:
            self.shards[name] = (offset, rows)
            offset += rows


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """RoPE on the first ``dim`` of each head of ``x`` [T, heads, D] (all of it usually)."""
    if dim == x.shape[-1]:
        return ops.rotate_halves(x, cos, sin)
    return torch.cat((ops.rotate_halves(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


class Attention(nn.Module):
    """q/k/v in one matmul, optional per-head q/k norms (Qwen3, Gemma 3), RoPE, then the
    attention backend (which also stores k and v in the paged pool)."""

    def __init__(self, info: ModelInfo, layer: int, qk_norm: type[RMSNorm] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            info.num_heads,
            info.num_kv_heads,
            info.head_dim,
        )
        self.rotary_dim = int(info.head_dim * info.partial_rotary_factor)
        self.q_size = info.num_heads * info.head_dim
        self.kv_size = info.num_kv_heads * info.head_dim
        self.qkv_proj = MergedLinear(
            info.hidden_size,
            [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)],
            bias=info.attention_bias,
        )
        self.o_proj = nn.Linear(self.q_size, info.hidden_size, bias=False)
        self.q_norm = qk_norm(info.head_dim, info.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(info.head_dim, info.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        meta: ForwardMeta,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rotary
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        if self.q_norm is None or self.k_norm is None:
            # q and k rotate in one op: [T, H + Hkv, D]
            qk = rotate(qkv[:, :k_end].view(T, -1, D), cos, sin, self.rotary_dim)
            q, k = qk.split([H, Hkv], dim=1)
        else:  # each head normed over its D values before the rotation
            q = self.q_norm(qkv[:, :q_end].reshape(T * H, D)).view(T, H, D)
            k = self.k_norm(qkv[:, q_end:k_end].reshape(T * Hkv, D)).view(T, Hkv, D)
            q, k = rotate(q, cos, sin, self.rotary_dim), rotate(k, cos, sin, self.rotary_dim)
        v = qkv[:, k_end:].view(T, Hkv, D)
        out = backend.forward(q, k, v, self.layer, meta)  # [T, H D]
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; act is SiLU (Llama, Qwen, Phi) or tanh-GELU (Gemma)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"MLP activation {act!r} unsupported; known: silu, gelu_pytorch_tanh")
        self.act = act
        self.gate_up_proj = MergedLinear(
            hidden, [("gate_proj", intermediate), ("up_proj", intermediate)], bias=False
        )
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
