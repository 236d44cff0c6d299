"""What a forward step must cost at best, for bench/forward.py: the bytes a decode step
reads and the FLOPs a prefill computes, for one ModelRunner as configured, and the
machine's measured bandwidth and GEMM throughput to divide them by."""

from __future__ import annotations

from typing import Any

import torch
from actorlm.gpu.kernels.qgemm import AMX_TILES_MIN_ROWS
from actorlm.gpu.model_info import ModelInfo
from actorlm.gpu.models.moe import SparseMoE
from actorlm.gpu.onednn import OneDNNLinear
from actorlm.gpu.quantization import Fp16Linear, GGUFLinear, native_lin
from actorlm.gpu.runner import ModelRunner
from torch import nn

from bench import machine

__all__ = ["Limits", "decode_bytes", "gemm_kind", "prefill_flops"]


def _linears(model: nn.Module) -> list[nn.Module]:
    """Every linear layer as the method converted it, the LM head included."""
    found = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear | Fp16Linear | GGUFLinear | OneDNNLinear)
    ]
    inner = {id(m.dense) for m in found if isinstance(m, GGUFLinear)}
    found = [m for m in found if id(m) not in inner]
    head = getattr(model, "head", None)
    if head is not None and head not in found:
        found.append(head)
    return found


def _expert_shares(model: nn.Module, batch: int) -> dict[int, float]:
    """Each sparse MoE expert linear's share of a step of ``batch`` rows: the experts a
    step is expected to touch, with every row routed uniformly (1 - (1 - k/E)^batch of
    them), for the bytes it reads; ``batch`` 0: k/E, for the FLOPs a row takes."""
    shares: dict[int, float] = {}
    for moe in model.modules():
        if isinstance(moe, SparseMoE):
            pick = moe.top_k / len(moe.experts)
            share = 1 - (1 - pick) ** batch if batch else pick
            for expert in moe.experts:
                shares.update({id(m): share for m in expert.modules() if m is not expert})
    return shares


def _shape(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, GGUFLinear):
        return m.packed.shape
    if isinstance(m, Fp16Linear):
        lin = m.lin()
        assert lin is not None
        return lin.n, lin.k
    assert isinstance(m, nn.Linear | OneDNNLinear)
    return m.out_features, m.in_features


def _dense_bytes(m: nn.Module) -> int:
    """What the layer reads for a batch beyond the block kernel's rows."""
    if isinstance(m, GGUFLinear):
        if m.dense is None:  # int8 rows: the blocks at every batch
            return sum(t.nbytes for t in m.lin.keep)
        return _dense_bytes(m.dense)
    n, k = _shape(m)
    if isinstance(m, Fp16Linear | OneDNNLinear):
        return n * k * 2
    assert isinstance(m, nn.Linear)
    return m.weight.nbytes


def decode_bytes(runner: ModelRunner, batch: int, context: int) -> int:
    """Bytes one decode step of ``batch`` sequences over ``context`` cached tokens reads:
    every weight once, as the step's path keeps it (a sparse MoE's experts that its rows
    are expected to pick), and each sequence's K and V."""
    fused = runner.fused
    small = fused is not None and batch <= fused.max_batch
    # from amx.h's AMX_DQ_MIN_ROWS rows the step's layers read their AMX tiles instead
    tiles = fused.step.tiles if fused is not None and small and batch >= AMX_TILES_MIN_ROWS else []
    total = float(sum(t.nbytes for t in tiles))
    experts = _expert_shares(runner.model, batch)
    for m in _linears(runner.model):
        if tiles and _shape(m)[0] != runner.info.vocab_size and id(m) not in experts:
            continue  # the step's tiles (experts have none)
        if small or (isinstance(m, GGUFLinear) and batch <= m.max_rows(runner.dtype)):
            lin = native_lin(m)
            assert lin is not None
            nbytes = sum(t.nbytes for t in lin.keep)
        else:
            nbytes = _dense_bytes(m)
        total += nbytes * experts.get(id(m), 1.0)
    model = runner.model
    if getattr(model, "tied", False) and getattr(model, "head", None) is None:
        total += model.lm_head_weight().nbytes  # logits straight from the embedding
    info = runner.info
    kv = runner.pool.kv.element_size() * 2 * info.num_layers * info.num_kv_heads * info.head_dim
    return int(total) + batch * context * kv


def prefill_flops(model: nn.Module, info: ModelInfo, tokens: int) -> float:
    """FLOPs of a fresh prompt: its linear layers (the LM head for one row) and causal
    attention (QK^T and PV over the lower triangle); a sparse MoE's experts for the
    rows routed to them."""
    head = getattr(model, "head", None)
    flops = 0.0
    experts = _expert_shares(model, 0)
    for m in _linears(model):
        n, k = _shape(m)
        rows = 1 if m is head or n == info.vocab_size else tokens
        flops += 2.0 * rows * n * k * experts.get(id(m), 1.0)
    attn = 2 * 2 * info.num_heads * info.head_dim * tokens * (tokens + 1) / 2
    return flops + info.num_layers * attn


def gemm_kind(runner: ModelRunner) -> str:
    """The GEMM a prefill's linear layers run: machine.gemm_flops' dtype name."""
    if any(isinstance(m, GGUFLinear) and m.dense is None for m in runner.model.modules()):
        return "int8"  # the *_a8 methods without a dense copy: int8 rows at every batch
    if runner.dtype == torch.bfloat16:
        return "bfloat16"
    if any(isinstance(m, Fp16Linear | GGUFLinear) for m in runner.model.modules()):
        return "fp16w"
    return "float32"


class Limits:
    """The machine's read bandwidth and GEMM throughput, measured once each."""

    def __init__(self) -> None:
        self.bandwidth = machine.read_bandwidth()
        self.measured: dict[str, float] = {}

    def gemm(self, kind: str, runner: ModelRunner, tokens: int = 512) -> float:
        if kind not in self.measured:
            shapes = {(tokens, *_shape(m)) for m in _linears(runner.model)}
            shapes = {s for s in shapes if s[1] != runner.info.vocab_size}
            self.measured[kind] = machine.gemm_flops(kind, shapes)["best"]
        return self.measured[kind]

    def as_dict(self) -> dict[str, Any]:
        return {"read_bandwidth": self.bandwidth, "gemm": dict(self.measured)}
