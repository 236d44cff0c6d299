"""Grammar bitmasks applied to logits: the greedy pick under a mask, and the mask
written into logits in place.

A mask is a packed int32 row (bit ``j`` of word ``w`` allows token ``32 * w + j``,
xgrammar's layout; tokens past a short mask's end are banned) or a bool ``[V]`` row
(True: may be sampled); ``None`` allows every token. The PyTorch path unpacks the
masks to a ``[M, V]`` bool tensor and fills a copy of the logits; at batch 32 of a
49k vocabulary that is two passes over ~6 MB and their allocations, ~2 ms a step
here (NOTES.md: xgrammar's own CPU ``apply_token_bitmask_inplace`` is slower still,
~0.3 ms a row). The C kernels (``cpu_bitmask.c``) read the packed words directly: the
greedy pick compares only allowed logits, 32 at a time, and writes nothing. They
take fp32 logits with unit column stride and packed masks of one width, on the CPU;
anything else, or ``ACTORLM_NATIVE=0``, takes the PyTorch path, which is also the
reference they are tested against.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import native

__all__ = ["apply_masks_", "banned", "masked_argmax", "masked_logits", "native_bitmask"]

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NEG_INF = float("-inf")
_ROWS_PER_THREAD = 64  # a team of two only pays past this: it is ~0.15 ms a 32-row step on one core, and a thread that waits for a busy core costs more


@cache
def native_bitmask() -> Any | None:
    """The compiled kernels, or None where they cannot be built."""
    return native.bind(
        Path(__file__).with_name("cpu_bitmask.c"),
        {
            "actorlm_masked_argmax": [_P, _I, _I, _I, _P, _I, _P, _T],
            "actorlm_apply_bitmask": [_P, _I, _I, _I, _P, _I, _T],
        },
    )


def _allowed(masks: Sequence[torch.Tensor], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Masks → ``[M, V]`` bool, True where a token may be sampled."""
    out = torch.zeros(len(masks), vocab_size, dtype=torch.bool, device=device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    for i, mask in enumerate(masks):
        mask = mask.to(device, non_blocking=True)
        if mask.dtype != torch.bool:
            mask = ((mask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten().bool()
        n = min(vocab_size, mask.numel())
        out[i, :n] = mask[:n]
    return out


def banned(masks: Sequence[torch.Tensor], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[M, V]`` bool, True where a token may not be sampled. Packed masks of one width
    on the CPU unpack in one numpy call (the words inverted first, so nothing of the
    size of the logits is computed twice)."""
    packed = all(m.dtype == torch.int32 and m.shape == masks[0].shape for m in masks)
    if not (packed and device.type == "cpu" and sys.byteorder == "little"):
        return ~_allowed(masks, vocab_size, device)
    words = ~torch.stack(list(masks)).numpy()
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    out = torch.from_numpy(bits).view(torch.bool)
    if out.shape[1] >= vocab_size:
        return out[:, :vocab_size]
    return torch.nn.functional.pad(out, (0, vocab_size - out.shape[1]), value=True)


def _pointers(x: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> tuple[Any, int] | None:
    """The masks as a C array of row pointers (NULL: no mask) and their width in words,
    or None when the kernels cannot take these tensors."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    if len(masks) != x.shape[0]:
        raise ValueError(f"{len(masks)} masks for {x.shape[0]} rows")
    words = -1
    ptrs: list[int | None] = []
    for m in masks:
        if m is None:
            ptrs.append(None)
            continue
        if m.dtype != torch.int32 or m.dim() != 1 or m.device.type != "cpu":
            return None
        if words not in (-1, m.shape[0]) or m.stride(0) != 1:
            return None
        words = m.shape[0]
        ptrs.append(m.data_ptr())
    return (ctypes.c_void_p * len(ptrs))(*ptrs), max(words, 0)


def _threads(rows: int) -> int:
    return max(1, min(torch.get_num_threads(), rows // _ROWS_PER_THREAD))


def masked_argmax(x: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``argmax`` of each row of ``x`` ``[B, V]`` with the tokens its mask bans at -inf
    (``torch.argmax``'s answer: the first maximum, or the first NaN). ``x`` is untouched."""
    lib = native_bitmask()
    c = _pointers(x, masks) if lib is not None else None
    if c is None:
        given = {i: m for i, m in enumerate(masks) if m is not None}
        picked = masked_logits(x, sorted(given), list(given.values())) if given else x
        return picked.argmax(dim=-1)
    ptrs, words = c
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.actorlm_masked_argmax(
        x.data_ptr(), x.stride(0), rows, vocab, ptrs, words, out.data_ptr(), _threads(rows)
    )
    return out


def masked_logits(x: torch.Tensor, rows: list[int], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """A copy of ``x`` with the tokens ``masks[k]`` bans in row ``rows[k]`` at -inf."""
    ban = banned(masks, x.shape[-1], x.device)
    if rows == list(range(x.shape[0])):  # every row masked: no gather
        return x.masked_fill(ban, _NEG_INF)
    out = x.clone()
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    out[index] = x[index].masked_fill(ban, _NEG_INF)
    return out


def apply_masks_(x: torch.Tensor, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """``x`` ``[B, V]`` with the tokens ``masks[row]`` bans at -inf: ``x`` itself, written
    in place by the kernel, or a masked copy from the PyTorch path."""
    rows = sorted(masks)
    lib = native_bitmask()
    per_row: list[torch.Tensor | None] = [masks.get(i) for i in range(x.shape[0])]
    c = _pointers(x, per_row) if lib is not None else None
    if c is None:
        return masked_logits(x, rows, [masks[i] for i in rows])
    ptrs, words = c
    lib.actorlm_apply_bitmask(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], ptrs, words, _threads(len(rows))
    )
    return x
