"""What every native model shares: the decoder loop over a ragged, paged batch, the
LM head over the sampled rows only, and loading HF-named tensors one at a time.

A family subclasses ``CausalLM`` and says what differs: its decoder layer
(``make_layer``), its norm, its RoPE tables (``make_ropes``, ``rope_of``), how it
scales embeddings and caps logits, and how its checkpoint names map onto its
modules (``rename``). The model knows nothing about messaging or the KV pool: the
attention backend is passed to ``forward`` with the step's metadata.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import AttentionBackend
from ..forward_meta import ForwardMeta
from ..model_info import ModelInfo
from .layers import MergedLinear, RMSNorm
from .rope import Rope

__all__ = ["CausalLM", "DecoderModel"]


class DecoderModel(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, info: ModelInfo, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        # An empty weight (meta under build_model) skips nn.Embedding's random init: its
        # normal_ on the meta device imports torch._dynamo, ~1.5 s of every worker start.
        empty = torch.empty(info.vocab_size, info.hidden_size)
        self.embed_tokens = nn.Embedding(info.vocab_size, info.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    activations: ClassVar[tuple[str, ...]] = ("silu",)

    def __init__(self, info: ModelInfo, max_model_len: int | None = None) -> None:
        super().__init__()
        if info.hidden_act not in self.activations:
            raise ValueError(
                f"{info.architecture}: hidden_act {info.hidden_act!r} unsupported "
                f"(this family uses {', '.join(self.activations)})"
            )
        self.info = info
        self.max_len = max(max_model_len or 0, info.max_model_len, info.max_position_embeddings)
        layers = [self.make_layer(i) for i in range(info.num_layers)]
        self.model = DecoderModel(
            info, layers, self.norm_class(info.hidden_size, info.rms_norm_eps)
        )
        self.tied = info.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(info.hidden_size, info.vocab_size, bias=False)
        self.ropes = self.make_ropes()
        # What the attention backend is built with and told each step.
        self.attention_scale = (info.query_pre_attn_scalar or info.head_dim) ** -0.5
        self.attention_softcap = float(info.attn_logit_softcapping or 0.0)
        self.layer_windows = [info.window(i) for i in range(info.num_layers)]
        # HF module path of a fused projection's part → (our module, first row, rows)
        self._shards: dict[str, tuple[str, int, int]] = {}
        for path, module in self.named_modules():
            if isinstance(module, MergedLinear):
                parent = path.rpartition(".")[0]
                for part, (first, rows) in module.shards.items():
                    self._shards[f"{parent}.{part}"] = (path, first, rows)
        for p in self.parameters():
            p.requires_grad_(False)
        self.head: nn.Module | None = None  # set by quantization: computes tied logits

    # -- what a family says -------------------------------------------------------

    def make_layer(self, layer: int) -> nn.Module:
        """Decoder layer ``layer``: ``(x, residual, rotary, meta, backend) → (x, residual)``."""
        raise NotImplementedError

    def make_ropes(self) -> list[Rope]:
        info = self.info
        dim = int(info.head_dim * info.partial_rotary_factor)
        return [
            Rope(
                dim, info.rope_theta, self.max_len, info.rope_scaling, info.max_position_embeddings
            )
        ]

    def rope_of(self, layer: int) -> int:
        """Which of ``make_ropes``'s tables layer ``layer`` reads."""
        return 0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rename(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model's terms; None to skip it."""
        return name

    # -- forward --------------------------------------------------------------------

    def set_lm_head(self, head: nn.Module) -> None:
        """Compute logits with ``head`` (a converted linear) instead of the tied weight."""
        self.head = head

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(self, meta: ForwardMeta, backend: AttentionBackend) -> torch.Tensor:
        """Packed tokens of a ragged batch → logits [S, V] (fp32) for ``meta.sample_rows``."""
        x = self.embed(meta.input_ids)  # [T, hidden]
        tables = []
        for rope in self.ropes:
            cos, sin = rope.cos_sin(meta)  # [T, 1, D/2]
            tables.append((cos.to(x.dtype), sin.to(x.dtype)))
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, tables[self.rope_of(i)], meta, backend)
        assert residual is not None, "a model of no layers"
        if meta.sample_rows.numel() != meta.num_tokens:
            # [S, hidden]: the LM head only where a token is sampled
            x, residual = x[meta.sample_rows], residual[meta.sample_rows]
        x, _ = self.model.norm(x, residual)
        if self.head is not None:
            fp32 = getattr(self.head, "logits", None)  # a head that gives fp32 logits itself
            logits = fp32(x) if fp32 is not None else self.head(x).float()
        elif not self.tied:  # nn.Linear, or what a linear method converted it into
            logits = self.lm_head(x).float()
        else:
            logits = F.linear(x, self.lm_head_weight()).float()
        if cap := self.info.final_logit_softcapping:
            # in place: three passes over [S, vocab] without two fresh tensors of it
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    # -- loading: parameters may sit on the meta device until their first tensor arrives,
    # so a loader can materialize the model one tensor at a time (low peak memory).

    def load_weight(
        self, name: str, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> str | None:
        """Copy one HF-named tensor in; returns what it filled (``finish_loading`` checks
        the set), None if the tensor is not needed."""
        renamed = self.rename(name)
        if renamed is None or "rotary_emb.inv_freq" in renamed:
            return None
        if renamed == "lm_head.weight" and self.tied:
            return None
        module_name, _, leaf = renamed.rpartition(".")
        shard = self._shards.get(module_name)
        target = f"{shard[0]}.{leaf}" if shard else renamed
        try:
            param = self.get_parameter(target)
        except AttributeError:
            raise ValueError(f"{name}: no such parameter in {type(self).__name__}") from None
        if param.is_meta:
            param = self._materialize(target, device, dtype)
        rows = param.data if shard is None else param.data.narrow(0, shard[1], shard[2])
        if rows.shape != tensor.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(rows.shape)}, file has {tuple(tensor.shape)}"
            )
        rows.copy_(tensor)
        return f"{target}:{module_name.rpartition('.')[2]}" if shard else target

    def _materialize(self, target: str, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
        module_name, _, leaf = target.rpartition(".")
        module = self.get_submodule(module_name)
        old = getattr(module, leaf)
        new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device), requires_grad=False)
        setattr(module, leaf, new)
        return new

    def finish_loading(self, loaded: set[str]) -> None:
        """Check every parameter was filled (each part of a fused one, or all of it at
        once), then let modules fold what they precompute (``after_loading``)."""
        missing = []
        for path, module in self.named_modules():
            parts = list(module.shards) if isinstance(module, MergedLinear) else []
            for leaf, p in module.named_parameters(recurse=False):
                n = f"{path}.{leaf}" if path else leaf
                if p.is_meta:
                    missing.append(f"{n} (never materialized)")
                elif n not in loaded and not (parts and all(f"{n}:{s}" in loaded for s in parts)):
                    missing.append(n)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
        for module in self.modules():
            fold = getattr(type(module), "after_loading", None)
            if fold is not None:
                fold(module)
