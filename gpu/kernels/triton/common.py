"""What the Triton kernels share: tile sizes and the dot precision for a dtype."""

from __future__ import annotations

import torch
import triton

__all__ = ["LOG2E", "block_d", "check_pages", "precision", "upcast"]

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))


def block_d(head_dim: int) -> int:
    """tl.dot wants power-of-two tiles of at least 16: head size 80 runs in 128 lanes."""
    return max(16, triton.next_power_of_2(head_dim))


def upcast(x: torch.Tensor) -> bool:
    """Whether tl.dot's operands go to fp32 first: Triton's interpreter (CPU tensors)
    multiplies bf16 as raw integers (seen with triton 3.9.0), so it gets fp32 there;
    bf16 products are exact in fp32, as on tensor cores."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def precision(x: torch.Tensor) -> str:
    """fp32 keeps fp32 products (tf32 would cost ~1e-3 against the torch reference);
    16-bit inputs ignore it."""
    return "ieee" if x.dtype == torch.float32 or upcast(x) else "tf32"


def check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """The kernels address K and V with one set of strides, the last one unit."""
    if k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1:
        raise ValueError("K and V pages need the same strides and a unit last stride")
