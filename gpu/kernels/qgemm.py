"""GGUF block formats for the CPU's linear layers: Q4_1 and Q8_0, bit-exact.

A GGUF model's weights load dequantized to fp32. ``pack`` finds the 32-wide blocks
they came from (Q4_1: ``w = q * d + m`` with 16 levels; Q8_0: ``w = q * d``) and
keeps them only when they rebuild every weight bit for bit, so the packed layer
computes with the file's exact values; a weight that is not such a block format
(a full-precision model, an F16 tensor) packs to None; ``quantize`` rounds such a
weight to blocks instead, as llama.cpp's quantizer does. ``gemm`` then runs
``cpu_qgemm.c`` (over ``gemv.h``): each block expands to fp32 in registers and serves
up to 8 rows of activations, so a decode step reads ~5 bits a weight instead of 16
(fp16) or 32 and the multiply-adds stay fp32, for fp32 or bf16 activations. ``Lin``
describes any weight the kernels read (blocks, or dense fp32/bf16/fp16 rows) and
``linear`` runs one; ``kernels.step`` chains them into a whole decode step.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import native
from .arena import Arena

__all__ = [
    "AMX_DQ_MIN_ROWS",
    "AMX_TILES_MIN_ROWS",
    "BLOCK_KINDS",
    "QK",
    "Lin",
    "PackedWeight",
    "amx_ready",
    "amx_tiles",
    "dequantize_blocks",
    "gemm",
    "int8_ready",
    "lin_blocks",
    "lin_dense",
    "linear",
    "native_qgemm",
    "pack",
    "quantize",
]

QK = 32  # weights a block
_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


GROUP = 16  # output rows interleaved: one AVX-512 vector, two AVX2 ones


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight as blocks, interleaved by groups of 16 output rows for the
    kernel (rows padded to a multiple of 16 with zeros): ``d`` (and ``m`` for Q4_1)
    are [N/16, K/32, 16] fp16 (GGUF's own scales), ``q`` the codes: [N/16, K/32, 16,
    16] bytes whose low nibble is code k = 2i and high nibble k = 2i + 1 (Q4_1), or
    [N/16, K/32, 32, 16] int8 (Q8_0). A group's blocks lie one after another, so a
    decode step reads the weight as one stream."""

    kind: str  # "q4_1" or "q8_0"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    shape: tuple[int, int]

    def codes(self) -> torch.Tensor:
        """The codes as [N, K/32, 32] (int16)."""
        q = self.q.to(torch.int16)
        if self.kind == "q4_1":
            q = torch.stack((q & 15, q >> 4), dim=3).flatten(2, 3)  # [G, nb, 32, 16]
        return _rows(q.permute(0, 3, 1, 2), self.shape[0])

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``d`` and ``m`` as [N, K/32]."""
        n = self.shape[0]
        m = None if self.m is None else _rows(self.m.float().transpose(1, 2), n)
        return _rows(self.d.float().transpose(1, 2), n), m

    def dequantize(self) -> torch.Tensor:
        """The [N, K] fp32 weight the blocks encode."""
        d, m = self.scales()
        w = self.codes().float() * d.unsqueeze(-1)
        if m is not None:
            w = w + m.unsqueeze(-1)
        return w.reshape(self.shape)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[G, GROUP, ...] → [N, ...]: the groups' rows in order, padding dropped."""
    return t.reshape(-1, *t.shape[2:])[:n]


def _groups(a: np.ndarray) -> np.ndarray:
    """[N, nb, ...] → [G, nb, ..., GROUP]: rows padded to whole groups, the row index last."""
    pad = -a.shape[0] % GROUP
    if pad:
        a = np.concatenate((a, np.zeros((pad, *a.shape[1:]), a.dtype)))
    a = a.reshape(-1, GROUP, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _fp16(a: np.ndarray) -> np.ndarray | None:
    """``a`` as fp16 when that is exact (GGUF's scales are fp16), else None."""
    h = a.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), a) else None


def _exact_products(d: np.ndarray, code_bits: int) -> bool:
    """Whether ``q * d`` is exact in fp32 for every code of ``code_bits`` bits (the
    low ``code_bits`` of each scale's 23 mantissa bits are zero, as they are for
    fp16 scales), so the kernel's fused multiply-add rounds the same as the
    separate multiply and add checked here."""
    return not np.any(d.view(np.int32) & ((1 << code_bits) - 1))


def _pack_q4_1(blocks: np.ndarray) -> PackedWeight | None:
    lo = blocks.min(axis=-1, keepdims=True)
    d = (blocks.max(axis=-1, keepdims=True) - lo) / np.float32(15)
    safe = np.where(d > 0, d, np.float32(1))
    q = np.clip(np.rint((blocks - lo) / safe), 0, 15).astype(np.uint8)
    qf = q.astype(np.float32)
    if not _exact_products(d, 4) or not np.array_equal(qf * d + lo, blocks):
        return None
    d16, lo16 = _fp16(d[..., 0]), _fp16(lo[..., 0])
    if d16 is None or lo16 is None:
        return None
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, nb, 16]
    n, nb, _ = blocks.shape
    return PackedWeight(
        "q4_1",
        torch.from_numpy(_groups(pairs)),
        torch.from_numpy(_groups(d16)),
        torch.from_numpy(_groups(lo16)),
        (n, nb * QK),
    )


def _pack_q8_0(blocks: np.ndarray) -> PackedWeight | None:
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(d > 0, d, np.float32(1))
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    qf = q.astype(np.float32)
    if not _exact_products(d, 7) or not np.array_equal(qf * d, blocks):
        return None
    d16 = _fp16(d[..., 0])
    if d16 is None:
        return None
    n, nb, _ = blocks.shape
    return PackedWeight(
        "q8_0",
        torch.from_numpy(_groups(q)),
        torch.from_numpy(_groups(d16)),
        None,
        (n, nb * QK),
    )


def pack(weight: torch.Tensor, native_pack: bool = True) -> PackedWeight | None:
    """``weight`` [N, K] as Q4_1 or Q8_0 blocks that rebuild it exactly, else None.
    ``cpu_pack.c`` finds them where it builds (the same result, in one pass), NumPy
    elsewhere or with ``native_pack=False``."""
    if weight.dim() != 2 or weight.shape[1] % QK or weight.numel() == 0:
        return None
    t = weight.detach().to("cpu", torch.float32).contiguous()
    lib = _pack_lib() if native_pack else None
    if lib is not None:
        # as below: the first row picks the format, then every row must be exact in it
        kind = next((k for k in ("q4_1", "q8_0") if _find(lib, k, t[:1]) is not None), None)
        return None if kind is None else _find(lib, kind, t)
    w = t.numpy()
    blocks = w.reshape(w.shape[0], -1, QK)
    with np.errstate(all="ignore"):  # inf/nan weights fail the checks
        # one row picks the format: a weight of another format costs no full pass
        fmt = next((f for f in (_pack_q4_1, _pack_q8_0) if f(blocks[:1]) is not None), None)
        if fmt is None or not np.isfinite(blocks).all():
            return None
        return fmt(blocks)


def quantize(
    weight: torch.Tensor, kind: str, values: torch.Tensor | None = None, native: bool = True
) -> PackedWeight | None:
    """``weight`` [N, K] rounded to ``kind`` ("q8_0" or "q4_1") blocks the way llama.cpp's
    reference quantizer (and ``gguf.quants``) rounds them, bit for bit: Q8_0 ``d = max|w| /
    127``, codes ``roundf(w / d)``; Q4_1 ``d = (max - min) / 15``, ``m = min``, codes
    ``trunc((w - m) / d + 0.5)``; codes from the fp32 scales, which are then stored as
    fp16. ``values`` ([N, K], contiguous), if given, receives the weight the blocks
    encode, as ``PackedWeight.dequantize`` gives it: fp32, or that ``.to(torch.bfloat16)``
    in a bf16 tensor (a bf16 model's dense copy, without an fp32 one). None where K is
    not a multiple of 32, or a weight or scale is not finite. ``cpu_pack.c`` rounds
    where it builds (the same bits, ~3x faster a core and on every core), torch's ops
    elsewhere or with ``native=False``."""
    if weight.dim() != 2 or weight.shape[1] % QK or weight.numel() == 0:
        return None
    if kind not in ("q8_0", "q4_1"):
        raise ValueError(f"block format {kind!r} unknown; known: q8_0, q4_1")
    n, k = weight.shape
    if values is not None and (
        values.shape != weight.shape
        or values.dtype not in (torch.float32, torch.bfloat16)
        or not values.is_contiguous()
    ):
        raise ValueError("quantize: values must be a contiguous fp32 or bf16 [N, K] tensor")
    q4 = kind == "q4_1"
    codes = torch.empty(n, k // QK, QK // 2 if q4 else QK, dtype=torch.uint8 if q4 else torch.int8)
    d16 = torch.empty(n, k // QK, dtype=torch.float16)
    m16 = torch.empty_like(d16) if q4 else None
    lib = _pack_lib() if native else None
    # rows a slice at a time: a model's largest weight (an LM head) is ~10^8 values, and
    # whole-weight temporaries each cost a fresh allocation's page faults
    for r0 in range(0, n, _QUANTIZE_ROWS):
        w = weight[r0 : r0 + _QUANTIZE_ROWS].detach().to("cpu", torch.float32).contiguous()
        out = None if values is None else values[r0 : r0 + w.shape[0]].view(w.shape[0], -1, QK)
        m_rows = None if m16 is None else m16[r0:]
        if lib is not None:
            done = _round_rows_native(lib, q4, w, codes[r0:], d16[r0:], m_rows, out)
        else:
            done = _round_rows(w.reshape(w.shape[0], -1, QK), codes[r0:], d16[r0:], m_rows, out)
        if not done:
            return None
    parts = [torch.from_numpy(_groups(t.numpy())) for t in (codes, d16)]
    m = None if m16 is None else torch.from_numpy(_groups(m16.numpy()))
    return PackedWeight(kind, parts[0], parts[1], m, (n, k))


_QUANTIZE_ROWS = 4096


def _round_rows(
    blocks: torch.Tensor,
    codes: torch.Tensor,
    d16: torch.Tensor,
    m16: torch.Tensor | None,
    values: torch.Tensor | None,
) -> bool:
    """``quantize`` for one slice of rows [R, K/32, 32] (fp32) into the first R rows of
    ``codes``, ``d16`` (and ``m16``: Q4_1) and ``values`` [R, K/32, 32] (fp32 or bf16);
    False where a weight or scale is not finite."""
    rows = blocks.shape[0]
    # inf, NaN: the block's too (amax and amin: ~2x torch's aminmax over rows of 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    if m16 is None:  # Q8_0
        d = torch.maximum(hi, -lo) / 127
        x = blocks * torch.where(d == 0, 0, 1 / d)
        # gguf.quants' np_roundf: halves away from zero, no rounding of a + 0.5; floor is
        # trunc on these non-negative values (torch's trunc ~3x its floor)
        a = x.abs()
        f = a.trunc()
        q = a.sub_(f).mul_(2).trunc_().add_(f).copysign_(x).add_(0.0)  # -0 -> 0, as the codes
        codes[:rows] = q
    else:
        d = (hi - lo) / 15
        q = (blocks - lo).mul_(torch.where(d == 0, 0, 1 / d)).add_(0.5).trunc_().clamp_(0, 15)
        q8 = q.to(torch.uint8)
        codes[:rows] = q8[..., 0::2] | (q8[..., 1::2] << 4)
        m16[:rows] = lo[..., 0]
    d16[:rows] = d[..., 0]
    if values is not None:  # dequantize's arithmetic in fp32: q * d, then + m
        v = q * d16[:rows, :, None].float()
        if m16 is not None:
            v += m16[:rows, :, None].float()
        values.copy_(v)  # fp32, or converted to bf16
    ok = bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())
    return (
        ok
        and bool(torch.isfinite(d16[:rows]).all())
        and (m16 is None or bool(torch.isfinite(m16[:rows]).all()))
    )


def _round_rows_native(
    lib: Any,
    q4: bool,
    w: torch.Tensor,
    codes: torch.Tensor,
    d16: torch.Tensor,
    m16: torch.Tensor | None,
    values: torch.Tensor | None,
) -> bool:
    """``_round_rows`` by ``cpu_pack.c``: ``w`` [R, K] fp32, contiguous; the outputs'
    first R rows (each contiguous, as ``quantize`` allocates and checks them); ``values``
    fp32 or bf16."""
    n, k = w.shape
    return bool(
        lib.actorlm_quantize_blocks(
            int(q4), w.data_ptr(), n, k, codes.data_ptr(), d16.data_ptr(),
            None if m16 is None else m16.data_ptr(),
            None if values is None else values.data_ptr(),
            int(values is not None and values.dtype == torch.bfloat16),
            len(os.sched_getaffinity(0)),
        )
    )  # fmt: skip


@cache
def _pack_lib() -> Any | None:
    lib = native.load(Path(__file__).with_name("cpu_pack.c"))
    if lib is not None:
        lib.actorlm_find_blocks.argtypes = [_T, _P, _I, _I, _P, _P, _P, _T]
        lib.actorlm_find_blocks.restype = ctypes.c_int
        lib.actorlm_quantize_blocks.argtypes = [_T, _P, _I, _I, _P, _P, _P, _P, _T, _T]
        lib.actorlm_quantize_blocks.restype = ctypes.c_int
        for name in ("actorlm_dequant_q4_1", "actorlm_dequant_q8_0"):
            getattr(lib, name).argtypes = [_P, _I, _P, _T]
            getattr(lib, name).restype = None
    return lib


_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}


def dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray | None:
    """GGUF ``kind`` blocks (``raw``: a tensor's bytes, C-contiguous) as fp32 [blocks *
    32], the values ``gguf.quants.dequantize`` gives, or None where ``cpu_pack.c`` does
    not build (the caller then uses gguf.quants)."""
    lib = _pack_lib()
    if lib is None or kind not in _BLOCK_BYTES or not raw.flags.c_contiguous:
        return None
    blocks = raw.size // _BLOCK_BYTES[kind]
    out = np.empty(blocks * QK, dtype=np.float32)
    fn = lib.actorlm_dequant_q4_1 if kind == "q4_1" else lib.actorlm_dequant_q8_0
    fn(raw.ctypes.data, blocks, out.ctypes.data, torch.get_num_threads())
    return out


def _find(lib: Any, kind: str, w: torch.Tensor) -> PackedWeight | None:
    """``w`` [N, K] (contiguous fp32) as ``kind`` blocks by ``cpu_pack.c``, or None."""
    n, k = w.shape
    g, nb = -(-n // GROUP), k // QK
    d = torch.zeros(g, nb, GROUP, dtype=torch.float16)  # padding rows stay zero
    q4 = kind == "q4_1"
    q = torch.zeros(g, nb, QK // 2 if q4 else QK, GROUP, dtype=torch.uint8 if q4 else torch.int8)
    m = torch.zeros_like(d) if q4 else None
    ok = lib.actorlm_find_blocks(
        int(q4), w.data_ptr(), n, k, q.data_ptr(), d.data_ptr(),
        m.data_ptr() if m is not None else None, torch.get_num_threads(),
    )  # fmt: skip
    return PackedWeight(kind, q, d, m, (n, k)) if ok else None


class Lin(ctypes.Structure):
    """One weight as gemv.h's ``lin_t`` reads it; ``keep`` holds the tensors it points into."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("act_bf16", ctypes.c_int64),  # x may round to bf16 (a bf16 model): dot products
        ("act_int8", ctypes.c_int64),  # blocks: x may be quantized to int8 (dpi8.h)
        ("tiles", ctypes.c_void_p),  # the weight as AMX's bf16 B tiles (amx_tiles), or 0
    ]

    keep: tuple[torch.Tensor, ...] = ()


_DENSE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK_KINDS = {"q4_1": 3, "q8_0": 4}  # Lin.kind of each block format (gemv.h)
_TILE_KINDS = (_DENSE_KINDS[torch.bfloat16], *BLOCK_KINDS.values())  # amx_tiles writes
AMX_DQ_MIN_ROWS = 32  # bf16 rows from which AMX sums block weights rounded to bf16 (amx.h)
AMX_TILES_MIN_ROWS = 41  # bf16 rows from which a weight's tiles are read (amx.h)


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()


def lin_blocks(w: PackedWeight, bias: torch.Tensor | None = None) -> Lin:
    """``w`` (and an fp32 copy of ``bias``) as a kernel descriptor."""
    b = _bias(bias)
    lin = Lin(BLOCK_KINDS[w.kind], w.shape[0], w.shape[1], w.q.data_ptr(), w.d.data_ptr(),
              0 if w.m is None else w.m.data_ptr(), 0 if b is None else b.data_ptr())  # fmt: skip
    lin.keep = tuple(t for t in (w.q, w.d, w.m, b) if t is not None)
    return lin


def lin_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Lin | None:
    """A row-major [N, K] fp32/bf16/fp16 CPU weight as a kernel descriptor, or None."""
    kind = _DENSE_KINDS.get(weight.dtype)
    if kind is None or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    w = weight.detach().contiguous()
    b = _bias(bias)
    lin = Lin(kind, w.shape[0], w.shape[1], w.data_ptr(), 0, 0, 0 if b is None else b.data_ptr())
    lin.keep = tuple(t for t in (w, b) if t is not None)
    return lin


@cache
def native_qgemm(level: str = "") -> Any | None:
    """The compiled kernel for ISA ``level`` (default: the best here), or None where it
    cannot be built."""
    lib = native.load(Path(__file__).with_name("cpu_qgemm.c"), level)
    if lib is not None:
        fn = lib.actorlm_linear
        fn.argtypes = [ctypes.POINTER(Lin), _P, _I, _I, _I, _P, _I, _I, _T]
        fn.restype = ctypes.c_int
        tiles = lib.actorlm_amx_tiles
        tiles.argtypes, tiles.restype = [ctypes.POINTER(Lin), _P, _T], ctypes.c_int
    return lib


@cache
def amx_ready(level: str = "") -> bool:
    """Whether the build for ``level`` (default: the best here) runs bf16 rows on AMX
    tiles: an amx build, on a CPU whose kernel grants the tile state."""
    lib = native_qgemm(level)
    return lib is not None and bool(lib.actorlm_amx_ready())


def amx_tiles(lin: Lin, arena: Arena | None = None, level: str = "") -> torch.Tensor | None:
    """``lin``'s weight rounded to bf16 as the AMX kernels' B tiles (a block weight's
    values as ``q * d + m`` rounded once, as a bf16 model's dequantized copy holds them),
    and ``lin.tiles`` set to them: steps of many bf16 rows then load the tiles as they
    lie instead of expanding the weight at every call. None (``lin`` as it was) where
    the build for ``level`` has no tiles or the weight is not whole 32-wide blocks. The
    caller keeps the tensor alive as long as ``lin``; ``arena``, if given, holds it."""
    lib = native_qgemm(level)
    if lib is None or not amx_ready(level) or lin.k % QK or lin.kind not in _TILE_KINDS:
        return None
    groups = (lin.n + GROUP - 1) // GROUP
    n = groups * GROUP * lin.k // 2
    out = arena.empty(n, torch.int32) if arena is not None else torch.empty(n, dtype=torch.int32)
    if lib.actorlm_amx_tiles(ctypes.byref(lin), out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    lin.tiles = out.data_ptr()
    return out


@cache
def int8_ready(level: str = "") -> bool:
    """Whether the build for ``level`` (default: the best here) runs block weights over
    rows quantized to int8 (``Lin.act_int8``: dpi8.h, dpi8_avx2.h; every build but
    the generic one)."""
    lib = native_qgemm(level)
    return lib is not None and bool(lib.actorlm_int8_ready())


def linear(
    x: torch.Tensor, lin: Lin, level: str = "", out_dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for ``x`` [M, K] fp32 or bf16 on the CPU (the result in x's
    dtype, or ``out_dtype``: fp32 or bf16), or None when the kernel cannot take it (not
    built here, another device or dtype, a strided row)."""
    lib = native_qgemm(level)
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.dim() != 2
        or x.stride(1) != 1
    ):
        return None
    if x.shape[1] != lin.k:
        raise ValueError(f"x has {x.shape[1]} columns but the weight {lin.k}")
    y = x.new_empty(x.shape[0], lin.n, dtype=out_dtype or x.dtype)
    if y.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"cpu linear: no {y.dtype} output")
    bf16, y_bf16 = int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16)
    rc = lib.actorlm_linear(
        ctypes.byref(lin), x.data_ptr(), bf16, x.shape[0], x.stride(0), y.data_ptr(), y_bf16,
        lin.n, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("cpu linear: out of memory for its bf16 staging")
    return y


def gemm(x: torch.Tensor, w: PackedWeight, level: str = "") -> torch.Tensor | None:
    """``x @ w.T`` for ``x`` [M, K] fp32 or bf16 on the CPU, or None when the kernel
    cannot take it (see ``linear``)."""
    return linear(x, lin_blocks(w), level)
