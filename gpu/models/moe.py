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
installs its own with the same signature. The default, ``stacked_experts``, runs
the reference unless the experts are plain dense linears (no linear method turned
them into blocks): then their weights live stacked, one [E, ...] tensor per
projection (each expert's weight a view of it, so nothing is stored twice), and a
step whose tokens spread evenly enough over the experts runs all of them as two
batched GEMMs over rows padded to the busiest expert's count. Small experts are
call-bound: a decode step of the tiny test models spends more on 16 GEMM calls
than on their arithmetic, and two ``bmm`` calls run it ~3x faster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from ..kernels import ops
from .layers import GatedMLP

__all__ = ["ExpertsKernel", "Router", "SparseMoE", "grouped_experts", "stacked_experts"]

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


# Padded rows are computed and dropped; the batched path wins while they stay below
# this share of the real ones, or while the padded work is this small (call-bound).
_MAX_PADDING = 2.0
_SMALL_PADDED_MACS = 2**23


def stacked_experts(
    moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``grouped_experts``'s result from the stacked dense weights (``dense_experts``):
    one token runs its k experts directly; otherwise, while the routing is even enough,
    two ``bmm`` over [E, cap, ...] rows padded to the busiest expert's count, else one
    pair of GEMMs per expert that has tokens (views of the stack, no module call). Each
    token's k results are then weighted and summed in one pass."""
    stack = moe.dense_experts()
    if stack is None:
        return grouped_experts(moe, x, weights, ids)
    gate_up, down = stack  # [E, 2I, H], [E, H, I]
    linear = torch.nn.functional.linear
    T, k = ids.shape
    if T == 1:  # a decode step of one sequence: no sorting, no scatter
        out = None
        for e, w in zip(ids[0].tolist(), weights[0], strict=True):
            y = linear(moe.act_and_mul(linear(x, gate_up[e])), down[e]) * w
            out = y if out is None else out + y
        assert out is not None
        return out
    E, two_i, H = gate_up.shape
    flat = ids.reshape(-1)  # pair p = token p // k, its (p % k)-th expert
    counts_t = torch.bincount(flat, minlength=E)
    counts = counts_t.tolist()
    cap = max(counts)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    if E * cap <= _MAX_PADDING * flat.numel() or E * cap * H * two_i <= _SMALL_PADDED_MACS:
        # pair p's row in the padded block: its expert's first slot + its rank there
        rank = torch.empty_like(flat).index_copy_(0, order, torch.arange(flat.numel()))
        first = torch.cumsum(counts_t, 0) - counts_t
        slots = flat * cap + rank - first.index_select(0, flat)
        padded = x.new_zeros(E * cap, H).index_copy_(0, slots, x.repeat_interleave(k, dim=0))
        h = moe.act_and_mul(torch.bmm(padded.view(E, cap, H), gate_up.transpose(1, 2)))
        out = torch.bmm(h.view(E, cap, -1), down.transpose(1, 2)).view(E * cap, H)
        pairs = out.index_select(0, slots)  # [T * k, hidden] in pair order
    else:
        rows = x.index_select(0, order // k)
        done = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                part = rows[start : start + n]
                done[start : start + n] = linear(moe.act_and_mul(linear(part, gate_up[e])), down[e])
                start += n
        pairs = torch.empty_like(done).index_copy_(0, order, done)
    return torch.bmm(weights.to(pairs.dtype)[:, None, :], pairs.view(T, k, H)).view(T, H)


def _plain(module: nn.Module) -> bool:
    """An ``nn.Linear`` (or ``MergedLinear``) computing its own forward, without bias."""
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and module.bias is None
    )


class SparseMoE(nn.Module):
    experts_kernel: ClassVar[ExpertsKernel] = staticmethod(stacked_experts)
    plain_linears: ClassVar[bool] = True  # its experts' weights are stacked on first use

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
        self.act = act
        # (gate_up [E, 2I, H], down [E, H, I]) and the experts' weight pointers into them
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` over the last dim of [..., 2I] (an expert's ``GatedMLP`` math)
        → [N, I]."""
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        if self.act == "silu":
            return ops.silu_and_mul(rows)
        gate, up = rows.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def dense_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' weights stacked (gate_up [E, 2I, H], down [E, H, I]), or None when
        a linear method left other modules. Built on first use, after the loader and the
        linear method are done; each expert's parameter becomes a view of the stack. A
        later change (a cast, a conversion) moves or replaces the first and last experts'
        weights too, and it is redone; checking those two keeps the per-step cost flat
        in the number of experts."""
        experts: list[GatedMLP] = list(self.experts)  # type: ignore[arg-type]
        if self._stack is not None:
            gate_up, down = self._stack
            first, last = experts[0].gate_up_proj, experts[-1].down_proj
            if (
                _plain(first)
                and _plain(last)
                and first.weight.data_ptr() == gate_up.data_ptr()
                and last.weight.data_ptr() == down[-1].data_ptr()
            ):
                return self._stack
            self._stack = None
        lins = [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
        if not all(_plain(m) for m in lins) or len({m.weight.dtype for m in lins}) != 1:
            return None
        with torch.inference_mode(False):  # parameters, not inference tensors
            gate_up = torch.stack([e.gate_up_proj.weight.detach() for e in experts])
            down = torch.stack([e.down_proj.weight.detach() for e in experts])
            for i, e in enumerate(experts):
                e.gate_up_proj.weight = nn.Parameter(gate_up[i], requires_grad=False)
                e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self._stack = (gate_up, down)
        return self._stack

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
