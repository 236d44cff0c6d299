"""Rotary position embeddings with the HF scaling variants (default, linear, dynamic,
llama3, yarn, longrope): the cos/sin tables; ``ops.rotate_halves`` applies them.

Weights are in HF layout (rotate the two halves of each head), which is what the
GGUF loader restores by undoing llama.cpp's interleaving permutation. ``dim`` is
the rotated part of a head (all of it unless a family rotates a fraction).

YaRN and LongRoPE also scale cos and sin by an attention factor. LongRoPE keeps
two tables: a sequence whose end (as of this step, or its whole prompt's while it
is prefilled in chunks) lies past the original context reads the long factors, as
transformers decides per forward call. KV computed while the sequence was shorter
keeps its short-factor rotation, as vLLM's does; transformers' Phi-3 ``generate``
instead recomputes the whole sequence with the long factors when it crosses, so a
decode past the original context (and a prompt past it over a prefix cached by a
shorter request) can differ from it there. Dynamic NTK stretches each sequence's
base by its own length, as transformers does for one sequence.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..forward_meta import ForwardMeta

__all__ = ["KNOWN_SCALING", "Rope"]

KNOWN_SCALING = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (
        base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )  # [dim/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between blended
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn many times over the original context keep their
    frequency, slow ones are interpolated by ``factor``, a linear ramp between."""
    orig = float(s.get("original_max_position_embeddings") or max_pos)
    factor = float(s.get("factor") or max_pos / orig)
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = (
            _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
            if m and m_all
            else _yarn_mscale(factor)
        )
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def turns_dim(turns: float) -> float:  # the dimension that turns `turns` times over orig
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(fast), turns_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # share of the original frequency
    inv = _inv_freq(dim, base)
    return inv / factor * (1 - keep) + inv * keep, float(attn)


class Rope:
    """cos/sin tables for positions [0, max_len), built lazily on the first device seen."""

    def __init__(
        self,
        dim: int,
        base: float,
        max_len: int,
        scaling: dict[str, Any] | None,
        max_pos: int,
    ) -> None:
        self.dim = dim
        self.base = base
        self.max_len = max_len
        self.max_pos = max_pos  # the model's trained context (dynamic scaling starts past it)
        scaling = dict(scaling or {})
        self.kind = scaling.get("rope_type") or scaling.get("type") or "default"
        self.factor = float(scaling.get("factor") or 1.0)
        if self.kind not in KNOWN_SCALING:
            raise ValueError(
                f"RoPE scaling {self.kind!r} unsupported; known: {', '.join(KNOWN_SCALING)}"
            )
        self.attention_factor = 1.0
        self.long_from = 0  # longrope: sequences longer than this read the long table
        inv = _inv_freq(dim, base)
        self.long_inv: torch.Tensor | None = None
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        elif self.kind == "yarn":
            inv, self.attention_factor = _yarn(dim, base, scaling, max_pos)
        elif self.kind == "longrope":
            orig = int(scaling.get("original_max_position_embeddings") or max_pos)
            factor = float(scaling.get("factor") or max_pos / orig)
            attn = scaling.get("attention_factor")
            if attn is None:
                attn = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
            self.attention_factor, self.long_from = float(attn), orig
            # (models are built under torch.device("meta"): tables stay on the CPU)
            short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
            long = torch.tensor(scaling["long_factor"], dtype=torch.float32, device="cpu")
            inv, self.long_inv = inv / short, _inv_freq(dim, base) / long
        self.inv_freq = inv
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, D/2] (longrope: [2L, D/2], the long table after the short one)."""
        pos = torch.arange(self.max_len, dtype=torch.float32, device="cpu")
        invs = [self.inv_freq] if self.long_inv is None else [self.inv_freq, self.long_inv]
        freqs = torch.cat([torch.outer(pos, inv) for inv in invs])
        a = self.attention_factor
        return (freqs.cos() * a).to(device), (freqs.sin() * a).to(device)

    def cos_sin(self, meta: ForwardMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's positions → cos, sin [T, 1, D/2] (broadcast over heads)."""
        positions = meta.positions
        if self.kind == "dynamic" and meta.max_seq_len > self.max_pos:
            # NTK-aware: each sequence's base stretched by its own context (as HF does
            # per forward of one sequence), not by the batch's longest: a sequence's
            # tokens must not depend on what shares its step.
            lens = np.maximum(np.asarray(meta.seq_lens, np.float64), self.max_pos)
            stretch = (self.factor * lens / self.max_pos - (self.factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
            base = torch.from_numpy(np.repeat(self.base * stretch, meta.extend_lens)).float()
            exps = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
            inv = 1.0 / base[:, None] ** exps[None, :]  # [T, D/2], in fp32 as _inv_freq
            freqs = positions.float().cpu()[:, None] * inv
            return freqs.cos().to(positions.device)[:, None], freqs.sin().to(positions.device)[
                :, None
            ]
        if self._tables is None or self._tables[0].device != positions.device:
            self._tables = self._table(positions.device)
        cos, sin = self._tables
        if self.long_inv is not None:
            # each sequence's length (its whole prompt's while chunked) picks its table
            long = np.asarray(meta.seq_lens) > self.long_from
            if long.all():
                positions = positions + self.max_len
            elif long.any():  # per token; numpy: torch's repeat_interleave costs ~70 µs
                offsets = np.repeat(long * self.max_len, meta.extend_lens)
                positions = positions + torch.from_numpy(offsets).to(positions.device)
        return cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
