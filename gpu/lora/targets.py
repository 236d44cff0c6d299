"""Which projections an adapter may target, their shapes, and where each one lives in
the model's fused layers. Plain Python (no torch): the lora_loader checks adapters
against the same shapes the worker computes with.

HF (and PEFT) name seven projections per decoder layer; the model fuses q/k/v into
``self_attn.qkv_proj`` (rows ``[q | k | v]``) and gate/up into ``mlp.gate_up_proj``
(rows ``[gate | up]``), so an adapter's delta for ``k_proj`` is added to the k rows
of the fused output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..model_info import ModelInfo

__all__ = ["LORA_MODULES", "BaseShapes", "Placement", "placements"]

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the layer count and each projection's (in, out)."""

    num_layers: int
    modules: Mapping[str, tuple[int, int]]

    @classmethod
    def from_info(cls, info: ModelInfo) -> BaseShapes:
        hidden, inter = info.hidden_size, info.intermediate_size
        q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
        return cls(
            info.num_layers,
            {
                "q_proj": (hidden, q),
                "k_proj": (hidden, kv),
                "v_proj": (hidden, kv),
                "o_proj": (q, hidden),
                "gate_proj": (hidden, inter),
                "up_proj": (hidden, inter),
                "down_proj": (inter, hidden),
            },
        )


class Placement(NamedTuple):
    module: str  # the HF projection: q_proj, ...
    fused: str  # the model's module, relative to a decoder layer: self_attn.qkv_proj
    offset: int  # its first output row in the fused module
    rows: int


def placements(info: ModelInfo) -> list[Placement]:
    """Where each of ``LORA_MODULES`` lives in a decoder layer of the Llama family."""
    shapes = BaseShapes.from_info(info).modules
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    inter, hidden = info.intermediate_size, info.hidden_size
    return [
        Placement("q_proj", "self_attn.qkv_proj", 0, q),
        Placement("k_proj", "self_attn.qkv_proj", q, kv),
        Placement("v_proj", "self_attn.qkv_proj", q + kv, kv),
        Placement("o_proj", "self_attn.o_proj", 0, hidden),
        Placement("gate_proj", "mlp.gate_up_proj", 0, inter),
        Placement("up_proj", "mlp.gate_up_proj", inter, inter),
        Placement("down_proj", "mlp.down_proj", 0, hidden),
    ]
