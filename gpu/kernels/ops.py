"""Fused element-wise layers: RMSNorm (with the residual add folded in),
SiLU-and-multiply, and rotary embedding.

Each has a PyTorch path that runs anywhere and, for fp32 and bf16 tensors on the
CPU, a C kernel (``cpu_ops.c``, built by ``native``): one pass over memory instead of
a chain of 4-7 PyTorch ops, which at decode batch sizes cost more in dispatch than
in arithmetic (bench/forward.py, decode b=8: ~10% of the step), and in bf16 more than
the GEMMs at any size (torch's bf16 element-wise ops widen and narrow at every op: a
512-token bf16 prefill spent ~60% of its time in them). The bf16 kernels round where
HF's bf16 Llama rounds. On CUDA tensors each is one Triton kernel
(``triton/elementwise.py``, the same roundings) where triton imports. The names and
the in-place contract of ``fused_add_rms_norm`` follow SGLang's kernels, so a
model written against them ports as it is. ``ACTORLM_NATIVE=0`` keeps PyTorch.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import native

__all__ = [
    "fused_add_rms_norm",
    "native_ops",
    "rms_norm",
    "rotate_halves",
    "silu_and_mul",
    "write_kv",
]

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@cache
def native_ops() -> Any | None:
    """The compiled kernels, or None where they cannot be built."""
    return native.bind(
        Path(__file__).with_name("cpu_ops.c"),
        {
            "actorlm_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _F, _T],
            "actorlm_silu_and_mul": [_P, _I, _P, _I, _I, _I, _T],
            "actorlm_rope": [_P, _I, _I, _I, _I, _P, _P, _I, _T],
            "actorlm_rms_norm_bf16": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _F, _T],
            "actorlm_silu_and_mul_bf16": [_P, _I, _P, _I, _I, _I, _T],
            "actorlm_rope_bf16": [_P, _I, _I, _I, _I, _P, _P, _I, _T],
            "actorlm_kv_write": [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _T],
        },
    )


_KERNELS = {torch.float32: "", torch.bfloat16: "_bf16"}
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@cache
def _triton_kernels() -> Any | None:
    """``triton/elementwise.py``, or None without triton or with ``ACTORLM_NATIVE=0``."""
    if os.environ.get("ACTORLM_NATIVE", "1") == "0" or importlib.util.find_spec("triton") is None:
        return None
    from .triton import elementwise

    return elementwise


def _cuda(x: torch.Tensor) -> Any | None:
    """The Triton kernels for a CUDA tensor of a dtype they take, else None."""
    if x.device.type != "cuda" or x.dtype not in _CUDA_DTYPES:
        return None
    return _triton_kernels()


def _native(*tensors: torch.Tensor) -> tuple[Any, str] | tuple[None, None]:
    """The kernels and the name suffix of their dtype, when every tensor is a 2-D CPU
    tensor with unit inner stride, all fp32 or all bf16."""
    suffix = _KERNELS.get(tensors[0].dtype)
    for t in tensors:
        if (
            t.device.type != "cpu"
            or t.dtype != tensors[0].dtype
            or t.dim() != 2
            or t.stride(1) != 1
        ):
            return None, None
    lib = native_ops() if suffix is not None else None
    return (lib, suffix) if lib is not None else (None, None)  # type: ignore[return-value]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension of ``x`` [T, dim]."""
    if (tk := _cuda(x)) is not None and (out := tk.rms_norm(x, weight, eps)) is not None:
        return out
    lib, sfx = _native(x)
    if lib is None or not weight.is_contiguous() or weight.dtype != x.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    getattr(lib, f"actorlm_rms_norm{sfx}")(
        x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
        x.shape[0], x.shape[1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` then ``rms_norm(residual)``; returns (normed, residual).

    On the kernel path both happen in place: ``residual`` holds the sum and ``x``
    the normed rows (the caller must own both). Elsewhere new tensors may be returned.
    """
    if (tk := _cuda(x)) is not None and (
        done := tk.fused_add_rms_norm(x, residual, weight, eps)
    ) is not None:
        return done
    lib, sfx = _native(x, residual)
    if lib is None or not weight.is_contiguous() or weight.dtype != x.dtype:
        residual = residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual
    getattr(lib, f"actorlm_rms_norm{sfx}")(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads(),
    )  # fmt: skip
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` = [gate | up] of shape [T, 2d] → [T, d]."""
    d = x.shape[-1] // 2
    if (tk := _cuda(x)) is not None and (out := tk.silu_and_mul(x)) is not None:
        return out
    lib, sfx = _native(x)
    if lib is None:
        gate, up = x.split(d, dim=-1)
        return F.silu(gate) * up
    out = x.new_empty(x.shape[0], d)
    getattr(lib, f"actorlm_silu_and_mul{sfx}")(
        x.data_ptr(), x.stride(0), out.data_ptr(), d, x.shape[0], d, torch.get_num_threads()
    )
    return out


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout: ``x`` [T, heads, D], ``cos``/``sin`` [T, 1, D/2].

    On the kernel path ``x`` (a view into the caller's own buffer) is rotated in
    place and returned; elsewhere a rotated copy is returned.
    """
    T, heads, D = x.shape
    if (tk := _cuda(x)) is not None and (out := tk.rotate_halves(x, cos, sin)) is not None:
        return out
    cs, sn = cos.reshape(T, D // 2), sin.reshape(T, D // 2)
    lib, sfx = _native(x[:, 0], cs, sn)
    if lib is None or x.stride(1) != D or cs.stride(0) != sn.stride(0):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    getattr(lib, f"actorlm_rope{sfx}")(
        x.data_ptr(), x.stride(0), T, heads, D, cs.data_ptr(), sn.data_ptr(), cs.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    return x


def write_kv(layer_kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Store ``k``, ``v`` [T, heads, D] at flat ``slots`` [T] of one layer's pool
    [2, heads, pages, page_size, D] (contiguous, k's dtype); False where the kernel
    cannot take them (the caller's torch path then does). On CUDA, one Triton launch."""
    if (tk := _cuda(k)) is not None:
        return bool(tk.write_kv(layer_kv, slots, k, v))
    lib = native_ops()
    T, heads, D = k.shape
    if (
        lib is None
        or layer_kv.device.type != "cpu"
        or not layer_kv.is_contiguous()
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or any(t.dtype != layer_kv.dtype or t.stride(2) != 1 or t.stride(1) != D for t in (k, v))
    ):
        return False
    total = layer_kv.shape[2] * layer_kv.shape[3]
    lib.actorlm_kv_write(
        layer_kv.data_ptr(), total, slots.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), T, heads, D, k.element_size(), torch.get_num_threads(),
    )  # fmt: skip
    return True
