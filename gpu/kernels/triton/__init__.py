"""Triton kernels: paged attention (``decode``, ``extend``), segmented LoRA (``lora``) and
``ops``' element-wise layers on CUDA tensors (``elementwise``).

They run compiled on CUDA tensors, and on CPU tensors through Triton's interpreter when
``TRITON_INTERPRET=1`` was set before ``triton`` was first imported (the CPU test suite
does this; it is slow, numpy per program instance, and meant for tests only). The
submodules import triton at module level, so import them only where it is wanted; this
package itself imports nothing.
"""

from __future__ import annotations

import importlib.util

__all__ = ["interpreted", "triton_available"]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether this process's kernels run in Triton's interpreter (CPU tensors allowed).

    Decided once, when triton was first imported (its ``@jit`` library functions are
    built for one mode), so the kernels themselves tell, not the environment now.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from .decode import decode_split_kernel

    return isinstance(decode_split_kernel, InterpretedFunction)
