"""The element-wise layers on CUDA, one Triton kernel each: RMSNorm (the residual add
folded in, in place), SiLU-and-multiply, rotary embedding (in place), and the store of
a step's new K and V into a layer of the paged pool.

PyTorch runs each as a chain of kernels on the GPU (the add, then the norm; SiLU, then
the product; four products, two sums and a concatenation for RoPE; two ``index_copy_``
walking elements for the KV write), ~12 launches a layer of 1-6 us each. On an H200 a
decode step of an 8B model is 0.6-0.8 ms (8-10 %) shorter with these kernels
(bench/README.md, GPU). These are one launch a layer op, and they round
where ``ops.py``'s CPU kernels and HF's Llama round (a bf16 sum is stored before it is
normed; the normed value before the weight; SiLU before the product; RoPE's products
before their sum), so the CUDA and CPU paths compute the same function. fp32 runs the
same code with its roundings as no-ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "fused_add_rms_norm",
    "rms_norm",
    "rms_norm_kernel",
    "rope_kernel",
    "rotate_halves",
    "silu_and_mul",
    "silu_and_mul_kernel",
    "write_kv",
    "write_kv_kernel",
]

MAX_NORM_DIM = 65536  # one program holds a row: wider ones stay on PyTorch
SILU_BLOCK = 1024


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """``x`` (fp32) to ``dt``, to nearest even. bf16 by its bits: Triton's interpreter
    (the CPU tests) truncates a bf16 cast; compiled casts round as this does."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, rounded, x.to(dt))  # a NaN stays one
    else:
        return x.to(dt)


@triton.jit
def _fp32(x, dt: tl.constexpr):
    """``x`` rounded to ``dt`` and widened back: the value a store of dt would keep."""
    return _rounded(x, dt).to(tl.float32)


@triton.jit
def rms_norm_kernel(
    X,
    Res,
    W,
    Out,
    stride_x,
    stride_r,
    stride_o,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    x = tl.load(X + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(Res + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
        s = _rounded(x + r, Res.dtype.element_ty)  # the sum as stored is what is normed
        tl.store(Res + row * stride_r + cols, s, mask=live)
        x = s.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    tl.store(Out + row * stride_o + cols, _rounded(_fp32(x * scale, dt) * w, dt), mask=live)


@triton.jit
def silu_and_mul_kernel(X, Out, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < D
    g = tl.load(X + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + cols, mask=live, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    act = _fp32(g / (1.0 + tl.exp(-g)), dt)
    tl.store(Out + row * stride_o + cols, _rounded(act * u, dt), mask=live)


@triton.jit
def rope_kernel(
    X,
    Cos,
    Sin,
    stride_xt,
    stride_xh,
    stride_c,
    heads,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_live = d < HALF
    c = tl.load(Cos + t * stride_c + d, mask=d_live, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_c + d, mask=d_live, other=0.0).to(tl.float32)[None, :]
    first = X + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    live = (h < heads)[:, None] & d_live[None, :]
    x1 = tl.load(first, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=live, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    a = _fp32(x1 * c, dt) - _fp32(x2 * s, dt)
    b = _fp32(x2 * c, dt) + _fp32(x1 * s, dt)
    tl.store(first, _rounded(a, dt), mask=live)
    tl.store(first + HALF, _rounded(b, dt), mask=live)


@triton.jit
def write_kv_kernel(
    Pool,
    Slots,
    K,
    V,
    stride_kt,
    stride_vt,
    head_stride,
    v_offset,
    heads,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program a token: its K and V rows of every head to its slot, in one launch
    (PyTorch's index_copy_ takes two, each walking elements)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    live = (h < heads) & (d < D)
    dst = Pool + h.to(tl.int64) * head_stride + slot * D + d
    tl.store(dst, tl.load(K + t * stride_kt + h * D + d, mask=live), mask=live)
    tl.store(dst + v_offset, tl.load(V + t * stride_vt + h * D + d, mask=live), mask=live)


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
    eps: float,
) -> None:  # fmt: skip
    """One program a row of ``x`` [T, N]: ``out`` = norm(x (+ residual, stored back))."""
    T, N = x.shape
    if T:
        block = triton.next_power_of_2(N)
        res = x if residual is None else residual
        rms_norm_kernel[(T,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``ops.rms_norm`` for ``x`` [T, N]; None where the kernel does not take it."""
    if not _rows(x) or x.shape[1] > MAX_NORM_DIM or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``ops.fused_add_rms_norm`` in place (``residual`` holds the sum, ``x`` the normed
    rows); None where the kernel does not take them."""
    if (
        not (_rows(x) and _rows(residual))
        or residual.shape != x.shape
        or residual.dtype != x.dtype
        or x.shape[1] > MAX_NORM_DIM
        or not weight.is_contiguous()
    ):
        return None
    _norm(x, residual, weight, x, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``ops.silu_and_mul``: [T, 2d] → [T, d]; None where the kernel does not take it."""
    if not _rows(x):
        return None
    T, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    if T and d:
        silu_and_mul_kernel[(T, triton.cdiv(d, SILU_BLOCK))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=SILU_BLOCK, num_warps=4
        )
    return out


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``ops.rotate_halves`` in place on ``x`` [T, heads, D] (a view of the caller's
    buffer) with ``cos``/``sin`` [T, 1, D/2] of its dtype; None where the kernel does
    not take them."""
    T, heads, D = x.shape
    half = D // 2
    cs, sn = cos.reshape(T, half), sin.reshape(T, half)
    if (
        x.stride(2) != 1
        or cs.dtype != x.dtype
        or sn.dtype != x.dtype
        or cs.stride(1) != 1
        or sn.stride(1) != 1
        or cs.stride(0) != sn.stride(0)
    ):
        return None
    if T and heads:
        rope_kernel[(T,)](
            x, cs, sn, x.stride(0), x.stride(1), cs.stride(0), heads, half,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
            num_warps=4,
        )  # fmt: skip
    return x


def write_kv(layer_kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``ops.write_kv`` on CUDA: ``k``, ``v`` [T, heads, D] to flat ``slots`` [T] of
    ``layer_kv`` [2, heads, pages, page_size, D]; False where the kernel does not take
    them (the pool's torch path then does)."""
    T, heads, D = k.shape
    if (
        not layer_kv.is_contiguous()
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or any(t.dtype != layer_kv.dtype or t.stride(2) != 1 or t.stride(1) != D for t in (k, v))
    ):
        return False
    if T:
        head_stride = layer_kv.shape[2] * layer_kv.shape[3] * D
        write_kv_kernel[(T,)](
            layer_kv, slots, k, v, k.stride(0), v.stride(0), head_stride, heads * head_stride,
            heads, D, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(D),
            num_warps=4,
        )  # fmt: skip
    return True
