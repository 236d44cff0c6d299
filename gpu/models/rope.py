"""Rotary position embeddings with the HF scaling variants (default, linear, dynamic, llama3):
the cos/sin tables; ``ops.rotate_halves`` applies them.

Weights are in HF layout (rotate the two halves of each head), which is what the
GGUF loader restores by undoing llama.cpp's interleaving permutation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["Rope"]


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


class Rope:
    """cos/sin tables for positions [0, max_len), built lazily on the first device seen."""

    def __init__(
        self, head_dim: int, base: float, max_len: int, scaling: dict[str, Any] | None, max_pos: int
    ):
        self.head_dim = head_dim
        self.base = base
        self.max_len = max_len
        self.max_pos = max_pos  # the model's trained context (dynamic scaling starts past it)
        scaling = dict(scaling or {})
        self.kind = scaling.get("rope_type") or scaling.get("type") or "default"
        self.factor = float(scaling.get("factor", 1.0))
        if self.kind not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(
                f"RoPE scaling {self.kind!r} unsupported; known: default, linear, dynamic, llama3"
            )
        inv = _inv_freq(head_dim, base)
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        self.inv_freq = inv
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _table(
        self, inv_freq: torch.Tensor, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(
            torch.arange(length, dtype=torch.float32, device="cpu"), inv_freq
        )  # [L, D/2]
        return freqs.cos().to(device), freqs.sin().to(device)

    def cos_sin(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, 1, D/2] (broadcast over heads)."""
        if self.kind == "dynamic" and seq_len > self.max_pos:
            # NTK-aware: stretch the base with the current context, as HF does per forward.
            base = self.base * ((self.factor * seq_len / self.max_pos) - (self.factor - 1)) ** (
                self.head_dim / (self.head_dim - 2)
            )
            freqs = torch.outer(positions.float().cpu(), _inv_freq(self.head_dim, base))  # [T, D/2]
            return freqs.cos().to(positions.device)[:, None], freqs.sin().to(positions.device)[
                :, None
            ]
        if self._tables is None or self._tables[0].device != positions.device:
            self._tables = self._table(self.inv_freq, self.max_len, positions.device)
        cos, sin = self._tables
        return cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
