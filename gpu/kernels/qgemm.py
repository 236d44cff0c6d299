"""GGUF block formats for the CPU's linear layers: Q4_1 and Q8_0, bit-exact.

A GGUF model's weights load dequantized to fp32. ``pack`` finds the 32-wide blocks
they came from (Q4_1: ``w = q * d + m`` with 16 levels; Q8_0: ``w = q * d``) and
keeps them only when they rebuild every weight bit for bit, so the packed layer
computes with the file's exact values; a weight that is not such a block format
(a full-precision model, an F16 tensor) packs to None. ``gemm`` then runs
``cpu_qgemm.c``: each block expands to fp32 in registers and serves up to 8 rows
of activations, so a decode step reads ~4.5 bits a weight instead of 16 (fp16)
or 32 and the multiply-adds stay fp32.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import native

__all__ = ["QK", "PackedWeight", "gemm", "native_qgemm", "pack"]

QK = 32  # weights a block
_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class PackedWeight:
    """A [N, K] weight as blocks, interleaved by groups of 8 output rows for the
    kernel (rows padded to a multiple of 8 with zeros): ``d`` (and ``m`` for Q4_1)
    are [N/8, K/32, 8] fp32, ``q`` the codes: [N/8, K/32, 16, 8] bytes whose low
    nibble is code k = 2i and high nibble k = 2i + 1 (Q4_1), or [N/8, K/32, 32, 8]
    int8 (Q8_0)."""

    kind: str  # "q4_1" or "q8_0"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    shape: tuple[int, int]

    def codes(self) -> torch.Tensor:
        """The codes as [N, K/32, 32] (int16)."""
        q = self.q.to(torch.int16)
        if self.kind == "q4_1":
            q = torch.stack((q & 15, q >> 4), dim=3).flatten(2, 3)  # [G, nb, 32, 8]
        return _rows(q.permute(0, 3, 1, 2), self.shape[0])

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``d`` and ``m`` as [N, K/32]."""
        n = self.shape[0]
        m = None if self.m is None else _rows(self.m.transpose(1, 2), n)
        return _rows(self.d.transpose(1, 2), n), m

    def dequantize(self) -> torch.Tensor:
        """The [N, K] fp32 weight the blocks encode."""
        d, m = self.scales()
        w = self.codes().float() * d.unsqueeze(-1)
        if m is not None:
            w = w + m.unsqueeze(-1)
        return w.reshape(self.shape)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[G, 8, ...] → [N, ...]: the groups' rows in order, padding dropped."""
    return t.reshape(-1, *t.shape[2:])[:n]


def _groups(a: np.ndarray) -> np.ndarray:
    """[N, nb, ...] → [G, nb, ..., 8]: rows padded to groups of 8, the row index last."""
    pad = -a.shape[0] % 8
    if pad:
        a = np.concatenate((a, np.zeros((pad, *a.shape[1:]), a.dtype)))
    a = a.reshape(-1, 8, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


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
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [N, nb, 16]
    n, nb, _ = blocks.shape
    return PackedWeight(
        "q4_1",
        torch.from_numpy(_groups(pairs)),
        torch.from_numpy(_groups(d[..., 0])),
        torch.from_numpy(_groups(lo[..., 0])),
        (n, nb * QK),
    )


def _pack_q8_0(blocks: np.ndarray) -> PackedWeight | None:
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(d > 0, d, np.float32(1))
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    qf = q.astype(np.float32)
    if not _exact_products(d, 7) or not np.array_equal(qf * d, blocks):
        return None
    n, nb, _ = blocks.shape
    return PackedWeight(
        "q8_0",
        torch.from_numpy(_groups(q)),
        torch.from_numpy(_groups(d[..., 0])),
        None,
        (n, nb * QK),
    )


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` [N, K] as Q4_1 or Q8_0 blocks that rebuild it exactly, else None."""
    if weight.dim() != 2 or weight.shape[1] % QK or weight.numel() == 0:
        return None
    w = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    blocks = w.reshape(w.shape[0], -1, QK)
    with np.errstate(all="ignore"):  # inf/nan weights fail the checks
        # one row picks the format: a weight of another format costs no full pass
        fmt = next((f for f in (_pack_q4_1, _pack_q8_0) if f(blocks[:1]) is not None), None)
        if fmt is None or not np.isfinite(blocks).all():
            return None
        return fmt(blocks)


@cache
def native_qgemm() -> Any | None:
    """The compiled kernels, or None where they cannot be built."""
    return native.bind(
        Path(__file__).with_name("cpu_qgemm.c"),
        {
            "actorlm_gemm_q4_1": [_P, _I, _I, _P, _P, _P, _I, _I, _P, _I, _T],
            "actorlm_gemm_q8_0": [_P, _I, _I, _P, _P, _I, _I, _P, _I, _T],
        },
    )


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
    """``x @ w.T`` for ``x`` [M, K] fp32 on the CPU, or None when the kernel cannot
    take it (not built here, another device or dtype, a strided row)."""
    lib = native_qgemm()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
    ):
        return None
    N, K = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} columns but the weight {K}")
    y = x.new_empty(x.shape[0], N)
    threads = torch.get_num_threads()
    if w.kind == "q4_1":
        lib.actorlm_gemm_q4_1(
            x.data_ptr(), x.shape[0], x.stride(0), w.q.data_ptr(), w.d.data_ptr(),
            w.m.data_ptr(), N, K, y.data_ptr(), N, threads,  # type: ignore[union-attr]
        )  # fmt: skip
    else:
        lib.actorlm_gemm_q8_0(
            x.data_ptr(), x.shape[0], x.stride(0), w.q.data_ptr(), w.d.data_ptr(),
            N, K, y.data_ptr(), N, threads,
        )  # fmt: skip
    return y
