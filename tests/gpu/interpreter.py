"""Triton's interpreter for the CPU suite: ``DEVICE = enable()`` at the top of a test module,
before it imports triton or actorlm's Triton kernels.

Triton builds its ``@jit`` functions (its own library's too) for one mode when they are
defined, and the interpreter is chosen by ``TRITON_INTERPRET=1`` at that moment. So
``enable`` sets the variable, imports triton and every kernel module, keeps the mode on
for this process in triton's own setting (``knobs.runtime``: triton asks it again at
launches) and puts the environment back: later processes (actors spawned by other
tests) never see it. Test modules are imported at collection, before any test has
imported triton (through transformers, say), which is what makes this work in one
pytest process.

On a machine with CUDA nothing is switched: the same tests run the compiled kernels on
CUDA tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

__all__ = ["KERNEL_MODULES", "enable"]

KERNEL_MODULES = (
    "actorlm.gpu.kernels.triton.decode",
    "actorlm.gpu.kernels.triton.extend",
    "actorlm.gpu.kernels.triton.elementwise",
    "actorlm.gpu.kernels.triton.lora",
)


def enable() -> torch.device:
    """The device the kernels run on here; skips the calling module where they cannot."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[test]')", allow_module_level=True)
    if torch.cuda.is_available():
        return torch.device("cuda")
    already = "triton" in sys.modules
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton import knobs

        if knobs.runtime.interpret:
            # the attribute itself, not its setter: that would write the environment
            knobs.runtime.__dict__["interpret"] = True
        # imported lazily at the first launch otherwise, and it checks the mode
        importlib.import_module("triton.experimental.gluon")
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    from actorlm.gpu.kernels.triton import interpreted

    if not interpreted():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set"
            f"{' (by an earlier module)' if already else ''}; run this module on its own",
            allow_module_level=True,
        )
    return torch.device("cpu")
