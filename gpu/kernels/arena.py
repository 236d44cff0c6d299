"""Long-lived kernel tensors carved one after another from large private anonymous
mappings, advised into 2 MiB pages (``MADV_HUGEPAGE``: Linux's transparent huge pages in
their ``madvise`` mode, as many distributions ship them; elsewhere plain pages).

The fused step's AMX tiles (``qgemm.amx_tiles``, ~200 MiB for the default model) are
written once at load and read at every prompt step. Allocated one by one through the C
heap, they landed among the model's other tensors, and a 512-token prompt ran ~10%
slower than without them at all (104 against 94 ms, alternated four times, 2-core AMX
Xeon VM, 2026-12-05), the linear layers' blocks path included, which never read them;
carved in order from a few mappings, the same tiles ran it faster than the blocks (the
huge pages themselves measured level there, five alternations each way).

A tensor keeps its mapping alive (``torch.frombuffer`` holds it); the arena keeps only
its current mapping, so an arena dropped after a model's load frees nothing early and
holds nothing late.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

__all__ = ["Arena"]

_HUGE = 2 << 20  # a transparent huge page
_ALIGN = 4096  # each tensor starts on its own page


class Arena:
    """Tensors carved from mappings of ``chunk`` bytes (larger requests get their own)."""

    def __init__(self, chunk: int = 64 << 20) -> None:
        self.chunk = chunk
        self._buf: torch.Tensor | None = None  # the current mapping's aligned bytes
        self._used = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` (zeros: fresh pages)."""
        nbytes = numel * dtype.itemsize
        if self._buf is None or self._used + nbytes > self._buf.numel():
            self._buf, self._used = _mapping(max(self.chunk, nbytes)), 0
        out = self._buf[self._used : self._used + nbytes].view(dtype)
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return out


def _mapping(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes starting on a 2 MiB boundary, advised into huge pages."""
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages: plain pages
            mm.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE
    return whole[start : start + nbytes]
