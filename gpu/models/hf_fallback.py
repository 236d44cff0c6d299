"""The transformers fallback: any decoder-only ``AutoModelForCausalLM`` over actorlm's
paged KV pool and attention backends (``--model-impl transformers``, or ``auto`` for
an architecture no native model registers).

transformers lets a caller plug in its own attention (``AttentionInterface``):
every attention layer of a model that supports it hands its q, k, v (RoPE applied)
to the registered function, with whatever keyword arguments the caller passed to
the model's forward. So the whole ragged batch runs as one sequence of packed
tokens, positions given explicitly, and the registered function forwards each
layer's q/k/v to the actorlm backend with the step's metadata: the pool stores
K/V, and continuous batching, chunked prefill and the prefix cache work as for a
native model. The rest of the model (embeddings, MLPs, norms, the LM head) runs
as transformers wrote it, which is what makes it slower than native.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..model_info import ModelInfo

__all__ = ["ATTENTION_NAME", "TransformersCausalLM", "paged_attention"]

log = logging.getLogger(__name__)

ATTENTION_NAME = "actorlm_paged"


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (q [1, H, T, D], k/v [1, Hkv, T, D] → [1, T, H, D])
    over the actorlm backend and metadata passed down as ``actorlm_backend``/``actorlm_meta``."""
    meta: ForwardMeta = kwargs["actorlm_meta"]
    backend: AttentionBackend = kwargs["actorlm_backend"]
    layer = getattr(module, "layer_idx", None)
    if layer is None or not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__}: the fallback runs causal decoder layers only")
    if kwargs.get("s_aux") is not None:  # checked at load for GPT-OSS; any other model too
        raise ValueError(f"layer {layer}: attention sinks (s_aux) are not computed here")
    window = kwargs.get("sliding_window") or 0
    if window != meta.window(layer) or float(kwargs.get("softcap") or 0.0) != meta.logit_softcap:
        raise ValueError(
            f"layer {layer}: transformers asks for window {window}, soft cap "
            f"{kwargs.get('softcap')}, but the config was read as {meta.window(layer)}, "
            f"{meta.logit_softcap}"
        )
    _, H, T, D = query.shape
    if (H, key.shape[1], D) != (backend.num_heads, backend.num_kv_heads, backend.head_dim):
        raise ValueError(
            f"layer {layer}: transformers computes (heads, kv heads, head dim) "
            f"{(H, key.shape[1], D)}, but the KV pool was sized from config.json as "
            f"{(backend.num_heads, backend.num_kv_heads, backend.head_dim)}"
        )
    q = query[0].transpose(0, 1)  # [T, H, D]
    if scaling is not None and scaling != backend.scale:
        q = q * (scaling / backend.scale)  # the backend's scale is fixed at construction
    out = backend.forward(q, key[0].transpose(0, 1), value[0].transpose(0, 1), layer, meta)
    return out.view(1, T, H, D), None


class TransformersCausalLM(nn.Module):
    """An HF model whose attention runs on actorlm's backend; the runner's interface."""

    def __init__(
        self, path: Path, info: ModelInfo, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        import transformers
        from transformers import AttentionInterface, AutoModelForCausalLM

        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(path), attn_implementation=ATTENTION_NAME, dtype=dtype
        )
        self.hf = model.to(device)
        if not type(self.hf).is_backend_compatible():
            raise ValueError(
                f"{info.architecture}: transformers' implementation does not pass attention "
                "to a registered function (_supports_attention_backend), so the fallback cannot run it"
            )
        self.hf.eval().requires_grad_(False)
        if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in self.hf.modules()):
            # GPT-OSS: learned attention sinks (transformers' s_aux), a term of every
            # softmax the paged backends do not have: without it every token is wrong
            raise ValueError(
                f"{info.architecture}: its attention has learned sinks, which actorlm's "
                "attention backends do not compute, so the fallback cannot run it"
            )
        self._check_geometry(info)
        self.info = info
        self.attention_scale: float | None = None  # head_dim ** -0.5; layers rescale q
        self.attention_softcap = float(info.attn_logit_softcapping or 0.0)
        self.layer_windows = [info.window(i) for i in range(info.num_layers)]
        from actorlm.extensions.points import MODELS

        log.warning(
            "model %s (%s): running the transformers fallback (%s; transformers %s with "
            "actorlm's paged attention, slower than a native model)",
            path,
            info.architecture,
            f"the native model lacks {' and '.join(info.native_gaps)}"
            if info.native_gaps and info.architecture in MODELS
            else "chosen by --model-impl"
            if info.architecture in MODELS
            else "no native model",
            transformers.__version__,
        )

    def _check_geometry(self, info: ModelInfo) -> None:
        """The KV pool was sized from config.json; transformers must agree on its shape."""
        cfg = self.hf.config.get_text_config()
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        ours = (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim)
        theirs = (int(cfg.num_hidden_layers), heads, kv, head_dim)
        if ours != theirs:
            raise ValueError(
                f"{info.architecture}: config.json read as (layers, heads, kv heads, head dim) "
                f"{ours}, transformers builds {theirs}"
            )

    def forward(self, meta: ForwardMeta, backend: AttentionBackend) -> torch.Tensor:
        """Packed tokens of a ragged batch → logits [S, V] (fp32) for ``meta.sample_rows``."""
        out = self.hf(
            input_ids=meta.input_ids[None],
            position_ids=meta.positions[None],
            use_cache=False,
            logits_to_keep=meta.sample_rows,
            actorlm_meta=meta,
            actorlm_backend=backend,
        )
        return out.logits[0].float()
