"""bf16 linears on the CPU with their weights packed once for oneDNN.

``F.linear`` on bf16 CPU tensors runs oneDNN's GEMM (AMX or AVX512-BF16), which
reorders the plain weight into its blocked layout on every call. Packing it once at
load time (``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's own CPU
compiler uses for frozen weights) and calling the packed GEMM skips that: 1.4-2x
faster at 8-128 rows (decode batches, short prompt chunks), ~1.25x at 256, level at
512 (the default model's layer shapes, 2-core Xeon with AMX, 2026-12-03).

The packed weight is opaque, so only a weight nothing else reads in its plain layout is
packed (``pack_linears``'s ``plain``): not the rows the fused CPU decode step reads, not
a tied LM head (the embeddings), not a view into a larger tensor, nothing under a
module that declares ``plain_linears = True`` (MoE experts, stacked on first use).
The packed copy replaces the plain one: no memory is added.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OneDNNLinear", "available", "pack_linears"]


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed bf16 GEMMs run here: a CPU with native bf16 (AMX or AVX512-BF16)
    and a PyTorch built with oneDNN."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    from .kernels.native import cpu_flags

    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


class OneDNNLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` packed for oneDNN; bf16 in, bf16 out."""

    # The batch-size hint the weight is packed for: 1 measured as fast as any at
    # 8-512 rows (the blocked layout oneDNN picks for AMX does not depend on it there).
    HINT_ROWS = 1

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.HINT_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().to(weight.dtype)
        if hasattr(linear, "shards"):  # a MergedLinear's map of its HF projections' rows
            self.shards = linear.shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"OneDNNLinear computes in bfloat16, not {x.dtype}")
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def packable(module: nn.Module) -> bool:
    """A plain bf16 ``nn.Linear`` (or ``MergedLinear``) on the CPU owning its weight."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    w = module.weight
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return False
    return w.untyped_storage().nbytes() == w.numel() * w.element_size()  # not a view


def pack_linears(model: nn.Module, plain: set[int]) -> int:
    """Replace every packable linear of ``model`` with a ``OneDNNLinear``, but those
    whose weight's ``data_ptr`` is in ``plain`` and those under a module whose class
    says ``plain_linears = True`` (its code reads their weights: MoE experts stacked on
    first use; a plugin's model or layer); returns the count."""
    kept = [n for n, m in model.named_modules() if getattr(type(m), "plain_linears", False)]

    def left_plain(name: str) -> bool:
        return any(not k or name == k or name.startswith(k + ".") for k in kept)

    targets = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and packable(m)
        and m.weight.data_ptr() not in plain
        and not left_plain(n)
    ]
    for name, module in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, OneDNNLinear(module))
    return len(targets)
