"""Small C kernels for the CPU, compiled on first use and loaded with ctypes.

PyTorch has no paged-attention op for the CPU, and a torch C++ extension takes
a minute to build; a plain C file with OpenMP builds in about a second with the
system compiler. The library is cached under ``$ACTORLM_CACHE_DIR`` (default
``$XDG_CACHE_HOME/actorlm``, or ``~/.cache/actorlm``) by a hash of the source, the
flags, the compiler and this CPU's feature flags (a source's ``#include "..."``
files are hashed with it), written atomically so several workers can race to
build it.

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
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["bind", "cache_dir", "load"]

log = logging.getLogger(__name__)

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def load(source: Path) -> ctypes.CDLL | None:
    """The compiled ``source`` (a C file), or None when it cannot be built here."""
    if os.environ.get("ACTORLM_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s falls back to PyTorch", source.name)
        return None
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (*_texts(source), *_FLAGS, compiler, _cpu_flags()))
    ).hexdigest()[:16]
    lib = cache_dir() / f"{source.stem}-{key}.so"
    if not lib.exists():
        try:
            _build(compiler, source, lib)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("building %s failed, falling back to PyTorch: %s", source.name, detail)
            return None
    # torch is imported first, so the library's libgomp is the one torch loaded:
    # one OpenMP thread pool, shared.
    import torch  # noqa: F401

    return ctypes.CDLL(str(lib))


def bind(source: Path, signatures: dict[str, list[Any]]) -> ctypes.CDLL | None:
    """``load(source)`` with the argument types of its named functions set (each
    returns void), or None when it cannot be built here."""
    lib = load(source)
    if lib is not None:
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    return lib


def _build(compiler: str, source: Path, lib: Path) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(source), "-o", tmp, "-lm"],
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
