"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias) over a ragged,
paged batch.

The model knows nothing about messaging or the KV pool: the attention backend
is passed to ``forward`` with the step's metadata, and only the rows that need
sampling reach the LM head (a prefill of 512 tokens computes one logits row).
Parameter names follow HF's; q/k/v and gate/up are fused into one matmul each,
and ``load_weight`` routes HF's separate tensors into their shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..kernels import ops
from ..model_info import ModelInfo
from .rope import Rope

__all__ = ["LlamaForCausalLM"]


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


class Attention(nn.Module):
    def __init__(self, info: ModelInfo, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            info.num_heads,
            info.num_kv_heads,
            info.head_dim,
        )
        self.q_size = info.num_heads * info.head_dim
        self.kv_size = info.num_kv_heads * info.head_dim
        # rows: [q | k | v]
        self.qkv_proj = nn.Linear(
            info.hidden_size, self.q_size + 2 * self.kv_size, bias=info.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, info.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: ForwardMeta,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        # q and k rotate in one op: [T, H + Hkv, D]
        qk = ops.rotate_halves(
            qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim), cos, sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, self.layer, meta)  # [T, H D]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)  # rows: [gate | up]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, info: ModelInfo, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(info, layer)
        self.mlp = MLP(info.hidden_size, info.intermediate_size)
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta, backend):  # type: ignore[no-untyped-def]
        """(x, residual) → (this layer's output, the running sum before it): the sum
        and the next norm fuse into one pass (``ops.fused_add_rms_norm``)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, info: ModelInfo) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(info.vocab_size, info.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(info, i) for i in range(info.num_layers))
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, info: ModelInfo, max_model_len: int | None = None) -> None:
        super().__init__()
        self.info = info
        self.model = LlamaModel(info)
        self.tied = info.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(info.hidden_size, info.vocab_size, bias=False)
        max_len = max(max_model_len or 0, info.max_model_len, info.max_position_embeddings)
        self.rope = Rope(
            info.head_dim, info.rope_theta, max_len, info.rope_scaling, info.max_position_embeddings
        )
        # HF tensor name → (our parameter, which shard of its rows)
        q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
        inter = info.intermediate_size
        self._shards = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        for p in self.parameters():
            p.requires_grad_(False)
        self.head: nn.Module | None = None  # set by quantization: computes tied logits

    def set_lm_head(self, head: nn.Module) -> None:
        """Compute logits with ``head`` (a converted linear) instead of the tied weight."""
        self.head = head

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, meta: ForwardMeta, backend: AttentionBackend) -> torch.Tensor:
        """Packed tokens of a ragged batch → logits [S, V] (fp32) for ``meta.sample_rows``."""
        x = self.model.embed_tokens(meta.input_ids)  # [T, hidden]
        cos, sin = self.rope.cos_sin(meta.positions, meta.max_seq_len)  # [T, 1, D/2]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta, backend)
        if meta.sample_rows.numel() != meta.num_tokens:
            # [S, hidden]: the LM head only where a token is sampled
            x, residual = x[meta.sample_rows], residual[meta.sample_rows]
        x, _ = self.model.norm(x, residual)
        if self.head is not None:
            return self.head(x).float()
        if not self.tied:  # nn.Linear, or what a linear method converted it into
            return self.lm_head(x).float()
        return F.linear(x, self.lm_head_weight()).float()

    # Loading: parameters may sit on the meta device until their first tensor arrives,
    # so a loader can materialize the model one tensor at a time (low peak memory).

    def load_weight(
        self, name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> str | None:
        """Copy one HF-named tensor in; returns what it filled (``finish_loading`` checks
        the set), None if the tensor is not needed."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tied:
            return None
        module_name, _, leaf = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        shard = self._shards.get(proj)
        target = f"{parent}.{shard[0]}.{leaf}" if shard else name
        param = self.get_parameter(target)
        if param.is_meta:
            param = self._materialize(target, device, dtype)
        rows = param.data if shard is None else param.data.narrow(0, shard[1], shard[2])
        if rows.shape != tensor.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(rows.shape)}, file has {tuple(tensor.shape)}"
            )
        rows.copy_(tensor)
        return f"{target}:{proj}" if shard else target

    def _materialize(self, target: str, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
        module_name, _, leaf = target.rpartition(".")
        module = self.get_submodule(module_name)
        old = getattr(module, leaf)
        new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device), requires_grad=False)
        setattr(module, leaf, new)
        return new

    def finish_loading(self, loaded: set[str]) -> None:
        expected = []
        for n, p in self.named_parameters():
            fused = [
                proj
                for proj, (param, _, _) in self._shards.items()
                if n.endswith(f".{param}.weight")
            ]
            if n.endswith("qkv_proj.bias"):
                fused = ["q_proj", "k_proj", "v_proj"]
            expected += [f"{n}:{proj}" for proj in fused] if fused else [n]
            if p.is_meta:
                expected.append(f"{n} (never materialized)")
        missing = [n for n in expected if n not in loaded]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
