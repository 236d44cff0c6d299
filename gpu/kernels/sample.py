"""Sampling rows of processed logits on the CPU in C (``cpu_sample.c``): temperature,
top-k, top-p over what top-k left, min-p, then one draw by the inverse CDF of the kept
weights at a uniform the caller gives each row (so a seeded row's draw depends on its
seed alone).

PyTorch's way, which ``gpu/sampling.py`` keeps for other devices, sorts the whole
vocabulary for top-k/top-p and draws an exponential a token for Gumbel-max; the kernel
makes a few vectorized passes over a row and sorts nothing (a cut's weight is found by
bisection). It takes fp32 CPU logits with unit column stride; anything else, or
``ACTORLM_NATIVE=0``, gets None and the caller takes the PyTorch path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from . import native

__all__ = ["LogprobRows", "logprob_rows", "native_sample", "sample_rows"]

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ROWS_PER_THREAD = 4  # a row is ~20-60 us at a 49k vocabulary: a team pays from a few


@cache
def native_sample(level: str = "") -> Any | None:
    """The compiled kernel for ISA ``level`` (default: the best here), or None where it
    cannot be built."""
    return native.bind(
        Path(__file__).with_name("cpu_sample.c"),
        {
            "actorlm_sample_rows": [_P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _T],
            "actorlm_logprob_rows": [_P, _I, _I, _P, _I, _P, _I, _P, _P, _P, _T],
        },
        level,
        ctypes.c_int,
    )


def _kernel_for(x: torch.Tensor, level: str) -> Any | None:
    """The build for ``level`` where it can read ``x``: fp32 CPU rows of unit stride."""
    lib = native_sample(level)
    readable = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
    return lib if readable and x.stride(1) == 1 else None


def sample_rows(
    x: torch.Tensor,
    rows: Sequence[int],
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    uniforms: Sequence[float],
    level: str = "",
) -> list[int] | None:
    """A token for each of ``x``'s rows ``rows`` (``x``: ``[B, V]`` processed logits),
    drawn with that row's settings (``temperature`` > 0; ``top_k`` <= 0: off; ``top_p``
    1: off; ``min_p`` 0: off) at its uniform in [0, 1), by the build for ISA ``level``
    (default: the best here); None where the kernel cannot take ``x`` (then sample with
    PyTorch)."""
    lib = _kernel_for(x, level)
    if lib is None:
        return None
    n = len(rows)
    idx = np.asarray(rows, np.int64)
    temps = np.asarray(temperature, np.float32)
    if n and (idx.min() < 0 or idx.max() >= x.shape[0] or not (temps > 0).all()):
        raise ValueError("rows out of range, or a temperature not above 0 (greedy rows argmax)")
    ks = np.asarray(top_k, np.int64)
    ps = np.asarray(top_p, np.float32)
    mins = np.asarray(min_p, np.float32)
    us = np.asarray(uniforms, np.float64)
    out = np.empty(n, np.int64)
    threads = max(1, min(torch.get_num_threads(), n // _ROWS_PER_THREAD))
    rc = lib.actorlm_sample_rows(
        x.data_ptr(), x.stride(0), x.shape[1], idx.ctypes.data, n, temps.ctypes.data,
        ks.ctypes.data, ps.ctypes.data, mins.ctypes.data, us.ctypes.data, out.ctypes.data,
        threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("sampling: out of memory for its scratch")
    return out.tolist()


class LogprobRows(NamedTuple):
    """Log-probabilities of some rows: each row's chosen token's, and its ``k`` best
    tokens' (ids and values, largest first; of equal values the first by id)."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_vals: list[list[float]]


def logprob_rows(
    x: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], k: int, level: str = ""
) -> LogprobRows | None:
    """``log_softmax`` of ``x``'s rows ``rows`` (``x``: ``[B, V]`` raw logits) at
    ``tokens`` (one a row) and their ``k`` best, in two passes over a row (its max with
    the best kept as they go by, then its sum of exp), by the build for ISA ``level``.
    None where the kernel cannot take ``x`` or a row has a NaN, no finite maximum or fewer
    than ``k`` values above -inf: torch answers those (its ties, its NaNs)."""
    lib = _kernel_for(x, level)
    if lib is None:
        return None
    n, vocab = len(rows), x.shape[1]
    idx = np.asarray(rows, np.int64)
    toks = np.asarray(tokens, np.int64)
    if n and (idx.min() < 0 or idx.max() >= x.shape[0] or toks.min() < 0 or toks.max() >= vocab):
        raise ValueError("rows or tokens out of range")
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}], got {k}")
    chosen = np.empty(n, np.float32)
    vals = np.empty((n, k), np.float32)
    ids = np.empty((n, k), np.int64)
    threads = max(1, min(torch.get_num_threads(), n // _ROWS_PER_THREAD))
    bad = lib.actorlm_logprob_rows(
        x.data_ptr(), x.stride(0), vocab, idx.ctypes.data, n, toks.ctypes.data, k,
        chosen.ctypes.data, vals.ctypes.data, ids.ctypes.data, threads,
    )  # fmt: skip
    return None if bad else LogprobRows(chosen.tolist(), ids.tolist(), vals.tolist())
