"""The bindings of ``cpu_decode.c`` (paged decode attention read from the KV pages in
place) and ``cpu_prefill.c`` (causal prefill and extend attention over the pages), used
by the ``cpu`` attention backend, ``actorlm.gpu.attention.cpu``."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from . import native

__all__ = ["decode_kernel", "prefill_kernel", "prefill_tiles"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def decode_kernel() -> Any | None:
    """The compiled ``actorlm_paged_decode``, or None where it cannot be built."""
    lib = native.load(Path(__file__).with_name("cpu_decode.c"))
    if lib is None:
        return None
    fn = lib.actorlm_paged_decode
    fn.argtypes = [_P, _I, _P, _P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def prefill_kernel(level: str = "") -> Any | None:
    """The compiled ``actorlm_paged_prefill`` for ISA ``level`` (default: the best
    here), or None where it cannot be built."""
    lib = native.load(Path(__file__).with_name("cpu_prefill.c"), level)
    if lib is None:
        return None
    fn = lib.actorlm_paged_prefill
    fn.argtypes = [
        _P,
        _I,
        _I,
        _P,
        _P,
        _I,
        _I,
        _P,
        _I,
        _I,
        _I,
        _I,
        _I,
        _I,
        _F,
        _P,
        _I,
        _I,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_int
    return fn


def prefill_tiles(level: str = "") -> bool:
    """Whether ``prefill_kernel(level)`` runs bf16 prompts whose head size is a multiple of
    64 on AMX tiles (``flash_amx.h``) here."""
    lib = native.load(Path(__file__).with_name("cpu_prefill.c"), level)
    return lib is not None and bool(lib.actorlm_prefill_tiles())
