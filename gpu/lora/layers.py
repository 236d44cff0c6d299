"""LoRA on the model's projections: each fused linear of a decoder layer wrapped so
its output gets the adapters' deltas, for the whole batch at once.

The wrapper computes whatever module was there (``nn.Linear``, or a linear
method's module: fp16, GGUF blocks), then adds each targeted projection's delta to
its rows of the fused output (q, k and v of ``qkv_proj``, say) with the step's plan
(``LoraMemoryPool.plan``): nothing to do when no row of the step uses an adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .pool import LoraMemoryPool
from .targets import Placement

__all__ = ["LoRALayer", "install_lora"]


class LoRALayer(nn.Module):
    """``base`` plus, for each of ``parts`` (its projections), the adapters' deltas."""

    def __init__(
        self, base: nn.Module, layer: int, parts: list[Placement], pool: LoraMemoryPool
    ) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.parts = parts
        self.pool = pool
        self.whole = len(parts) == 1 and parts[0].offset == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = self.pool.plan
        if plan is None:
            return y
        g = plan.gather
        xg = None if g is None else x.index_select(0, g.index).view(-1, g.rows, x.shape[1])
        for p in self.parts:
            out = y if self.whole else y.narrow(1, p.offset, p.rows)
            self.pool.apply(plan, x, xg, out, p.module, self.layer)
        return y


def install_lora(model: nn.Module, pool: LoraMemoryPool, placements: list[Placement]) -> int:
    """Wrap every fused projection of ``model.model.layers``; returns how many.
    Run it after the linear method converted the model (adapters sit on top)."""
    by_module: dict[str, list[Placement]] = {}
    for p in placements:
        by_module.setdefault(p.fused, []).append(p)
    count = 0
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for i, layer in enumerate(layers):
        for path, parts in by_module.items():
            parent_name, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            base = getattr(parent, leaf)
            if isinstance(base, LoRALayer):
                raise ValueError(f"layer {i} {path} already has LoRA")
            setattr(parent, leaf, LoRALayer(base, i, parts, pool))
            count += 1
    return count
