"""The command line refuses a configuration this machine cannot run in one line, before
starting anything."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_cuda_backend_on_a_cpu_machine_is_one_line_not_a_traceback(backend: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "actorlm.cli", "serve", "--attention-backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"actorlm: attention backend '{backend}' runs on CUDA devices only")
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
