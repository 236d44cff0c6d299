"""The binding of ``cpu_lora.c``: one projection's LoRA deltas over a batch in one call,
each row with its own adapter slot, over the CPU pool's rank-major weights.

``LoraDesc`` describes one projection of one layer (a ``lora_t``, ``lora.h``): it
points into the pool's tensors, so it is made once per (projection, layer) and stays
valid while they live; a slot loaded later is read through the same pointers, its rank
through the pool's rank tensor. The fused decode step (``step.py``) reads the same
descriptors. ``ACTORLM_NATIVE=0``, or no compiler, keeps the torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch

from . import native

__all__ = ["LORA_MAX_RANK", "LoraDesc", "describe", "lora_apply_native", "native_lora"]

LORA_MAX_RANK = 256  # lora.h: a token's shrink lives on the stack

_P, _I = ctypes.c_void_p, ctypes.c_int64
_DTYPES = (torch.float32, torch.bfloat16)


class LoraDesc(ctypes.Structure):
    """``lora_t``: one layer's [R, slots, k] A and [R, slots, n] B (scaled), the slots' ranks."""

    _fields_ = [
        ("a", _P),
        ("b", _P),
        ("ranks", _P),
        ("k", _I),
        ("n", _I),
        ("slots", _I),
        ("bf16", _I),
    ]


@cache
def native_lora() -> Any | None:
    """The compiled kernel, or None where it cannot be built."""
    lib = native.load(Path(__file__).with_name("cpu_lora.c"))
    if lib is not None:
        fn = lib.actorlm_lora_apply
        fn.argtypes = [_P, _I, _P, _I, _I, _I, _P, ctypes.POINTER(LoraDesc), ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def describe(a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor) -> LoraDesc | None:
    """The descriptor of ``a`` [R, slots, k] and ``b`` [R, slots, n] (contiguous, fp32 or
    bf16, on the CPU) with ``ranks`` [slots] int32, or None when the kernel cannot read them."""
    if (
        a.device.type != "cpu"
        or a.dtype not in _DTYPES
        or b.dtype != a.dtype
        or not (a.is_contiguous() and b.is_contiguous() and ranks.is_contiguous())
        or ranks.dtype != torch.int32
        or a.dim() != 3
        or b.shape[:2] != a.shape[:2]
        or ranks.shape != (a.shape[1],)
    ):
        return None
    return LoraDesc(
        a.data_ptr(),
        b.data_ptr(),
        ranks.data_ptr(),
        a.shape[2],
        b.shape[2],
        a.shape[1],
        int(a.dtype == torch.bfloat16),
    )


def lora_apply_native(
    x: torch.Tensor, y: torch.Tensor, desc: LoraDesc, row_slots: torch.Tensor
) -> bool:
    """``y[t] += (x[t] A^T) B^T`` with row ``t``'s slot ``row_slots[t]`` (int32; < 0 leaves
    the row alone). ``x`` [T, k] and ``y`` [T, n] (a column slice of a wider output is
    fine) are CPU fp32 or bf16 with unit column stride. False where the kernel cannot take
    them (the caller's torch path then does)."""
    lib = native_lora()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or y.dtype != x.dtype
        or x.dim() != 2
        or y.dim() != 2
        or x.stride(1) != 1
        or y.stride(1) != 1
        or (x.shape[1], y.shape[1]) != (desc.k, desc.n)
        or row_slots.dtype != torch.int32
        or not row_slots.is_contiguous()
        or row_slots.shape != (x.shape[0],)
        or y.shape[0] != x.shape[0]
    ):
        return False
    rc = lib.actorlm_lora_apply(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), int(x.dtype == torch.bfloat16),
        x.shape[0], row_slots.data_ptr(), ctypes.byref(desc), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("lora: rank over the kernel's limit, or out of scratch memory")
    return True
