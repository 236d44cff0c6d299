"""Mixture of experts as a layer: a router, top-k routing with the family's
normalization, and the experts run grouped by expert over the step's tokens.

Any model reuses ``SparseMoE`` in place of its dense MLP (Mixtral, Qwen3-MoE;
``shared_intermediate`` adds Qwen2-MoE's gated shared expert). Each expert is a
``GatedMLP`` of ordinary linear layers, so linear methods convert them like any
other (a GGUF's quantized expert blocks run its block kernel); the router stays
in full precision, since a rounded score can flip which experts a token gets.

The expert computation is a swappable kernel, ``SparseMoE.experts_kernel``:
``grouped_experts`` (the reference: tokens sorted by expert, one pair of GEMMs per
expert that has tokens) runs anywhere; a platform with a fused-MoE kernel (CUDA)
installs its own with the same signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from .layers import GatedMLP

__all__ = ["ExpertsKernel", "Router", "SparseMoE", "grouped_experts"]

# (layer, x [T, hidden], weights [T, k], expert ids [T, k]) → [T, hidden]
ExpertsKernel = Callable[["SparseMoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Router(nn.Module):
    """Expert scores ``x @ weight.T`` in full precision (not an ``nn.Linear``, so no
    linear method converts it)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def grouped_experts(
    moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every (token, expert) pair sorted by expert; each expert runs once over its rows;
    results weighted and summed back per token in expert order (as transformers does)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(moe.experts)).tolist()
    tokens = order // k
    rows = x.index_select(0, tokens)  # [T * k, hidden]
    out = torch.empty_like(rows)
    start = 0
    for expert, n in zip(moe.experts, counts, strict=True):
        if n:
            out[start : start + n] = expert(rows[start : start + n])
            start += n
    out.mul_(weights.reshape(-1)[order, None].to(out.dtype))
    return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoE(nn.Module):
    experts_kernel: ClassVar[ExpertsKernel] = staticmethod(grouped_experts)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        act: str = "silu",
        shared_intermediate: int = 0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden, num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, intermediate, act) for _ in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = Router(hidden, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (weights [T, k] fp32, expert ids [T, k]): softmax over all
        experts, the top k, renormalized to sum to 1 where the family does."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = type(self).experts_kernel(self, x, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
