"""Small C kernels for the CPU, compiled on first use and loaded with ctypes, one build
per instruction set.

PyTorch has no paged-attention op for the CPU, and a torch C++ extension takes
a minute to build; a plain C file with OpenMP builds in about a second with the
system compiler. Each source builds once per ISA level it is asked for (``ISAS``: ``amx`` = ``avx512bf16`` with AMX's bf16
tiles, ``avx512bf16`` = x86-64-v4 with AVX512-BF16, ``avx512`` = x86-64-v4, ``avx2`` =
x86-64-v3, ``generic`` = the compiler's baseline, which is what ARM gets), so the
binary depends on the level and not on the build machine; ``best_isa`` picks the
highest level this CPU's flags allow, and ``ACTORLM_ISA`` caps it
(``ACTORLM_ISA=avx2`` runs the AVX2 build on an AVX-512 CPU). The library is cached
under ``$ACTORLM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/actorlm``, or
``~/.cache/actorlm``) by a hash of the source and its ``#include "..."`` files, the
flags and the compiler, written atomically so several workers can race to build it.

Without a compiler, or with ``ACTORLM_NATIVE=0``, ``load`` returns None and the
caller keeps its pure-PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "ISAS",
    "Isa",
    "best_isa",
    "bind",
    "cache_dir",
    "cpu_flags",
    "isa",
    "load",
    "pick_isa",
    "supported_isas",
]

log = logging.getLogger(__name__)

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)
_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


@dataclass(frozen=True)
class Isa:
    """An instruction-set level a kernel builds for: the CPU flags it needs (as
    /proc/cpuinfo spells them) and the compiler flags that target it."""

    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]


_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Highest first. x86-64-v4 is AVX-512 F/BW/CD/DQ/VL over v3. AVX512-VNNI's int8 dot
# product and VBMI's byte permutes serve the rows quantized to int8 (dpi8.h, the
# `gguf_a8` linear methods): the avx512vnni level (Ice Lake, Tiger Lake, Rocket Lake;
# their bf16 arithmetic is emulated, so their models run fp32). AVX512-BF16's dot
# product serves bf16 rows over the block weights at batches beyond one tile of rows
# (gemv.h, dpbf16.h), and AMX's bf16 tiles serve them faster where the CPU has them
# (amx.h); every CPU with AVX512-BF16 has VNNI and VBMI too but Cooper Lake, which
# runs the avx512 level.
_VNNI = _X86_V4 | {"avx512_vnni", "avx512vbmi"}
_VNNI_CFLAGS = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi")
_BF16_VNNI = _VNNI | {"avx512_bf16"}
_BF16_VNNI_CFLAGS = (*_VNNI_CFLAGS, "-mavx512bf16")
ISAS: tuple[Isa, ...] = (
    Isa(
        "amx",
        _BF16_VNNI | {"amx_tile", "amx_bf16"},
        (*_BF16_VNNI_CFLAGS, "-mamx-tile", "-mamx-bf16", "-mtune=generic"),
    ),
    Isa("avx512bf16", _BF16_VNNI, (*_BF16_VNNI_CFLAGS, "-mtune=generic")),
    Isa("avx512vnni", _VNNI, (*_VNNI_CFLAGS, "-mtune=generic")),
    Isa("avx512", _X86_V4, ("-march=x86-64-v4", "-mtune=generic")),
    Isa("avx2", _X86_V3, ("-march=x86-64-v3", "-mtune=generic")),
    Isa("generic", frozenset(), ()),
)
_BY_NAME = {i.name: i for i in ISAS}


def isa(name: str) -> Isa:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown ISA {name!r}; known: {', '.join(_BY_NAME)}") from None


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def supported_isas(flags: Iterable[str], x86: bool = True) -> list[Isa]:
    """The levels a CPU with ``flags`` runs, highest first (``generic`` always last)."""
    have = set(flags)
    return [i for i in ISAS if (x86 or not i.needs) and i.needs <= have]


def pick_isa(flags: Iterable[str], cap: str = "", x86: bool = True) -> Isa:
    """The highest level a CPU with ``flags`` runs, at most ``cap`` (a level's name)."""
    levels = supported_isas(flags, x86)
    if cap:
        limit = ISAS.index(isa(cap))
        levels = [i for i in levels if ISAS.index(i) >= limit]
    return levels[0] if levels else _BY_NAME["generic"]


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def best_isa() -> Isa:
    """The level the kernels run at here: the best the CPU has, capped by ``ACTORLM_ISA``."""
    return pick_isa(cpu_flags(), os.environ.get("ACTORLM_ISA", ""), _is_x86())


def cache_dir() -> Path:
    root = os.environ.get("ACTORLM_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = str(Path(xdg) / "actorlm")
    return Path(root) / "kernels"


def _texts(source: Path) -> list[str]:
    """``source`` and the local headers it includes, recursively, for the cache key."""
    text = source.read_text()
    out = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        out += _texts((source.parent / name).resolve())
    return out


@cache
def load(source: Path, level: str = "") -> ctypes.CDLL | None:
    """The compiled ``source`` (a C file) for ISA ``level`` (default: ``best_isa()``),
    or None when it cannot be built here."""
    if os.environ.get("ACTORLM_NATIVE", "1") == "0":
        return None
    target = isa(level) if level else best_isa()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s falls back to PyTorch", source.name)
        return None
    flags = (*_FLAGS, *target.cflags)
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (*_texts(source), *flags, compiler))
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{target.name}-{key}.so"
    if not lib.exists():
        try:
            _build(compiler, flags, source, lib)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("building %s failed, falling back to PyTorch: %s", source.name, detail)
            return None
    # torch is imported first, so the library's libgomp is the one torch loaded:
    # one OpenMP thread pool, shared.
    import torch  # noqa: F401

    return ctypes.CDLL(str(lib))


def bind(
    source: Path, signatures: dict[str, list[Any]], level: str = "", restype: Any = None
) -> ctypes.CDLL | None:
    """``load(source, level)`` with the argument types of its named functions set (each
    returning ``restype``: void by default), or None when it cannot be built here."""
    lib = load(source, level)
    if lib is not None:
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def _build(compiler: str, flags: tuple[str, ...], source: Path, lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", lib)
