"""The AMX kernels hold their tests when the compiler does not inline them.

GCC's own AMX intrinsics (12, at least) tell the compiler that ``ldtilecfg`` reads 8
bytes and ``tileloadd`` none, so it may drop the stores they depend on. With the
configuration's helper inlined it happened to keep them; built without inlining it
dropped half of them and the first tile configuration faulted (SIGSEGV).
``amx_state.h``'s wrappers state what each reads; a build that does not inline
anything runs the AMX tests of the linears, prompt attention and decode attention.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from actorlm.gpu.kernels import native
from actorlm.gpu.kernels.qgemm import amx_ready

REPO = Path(__file__).resolve().parents[3]
AMX_TESTS = [
    "tests/gpu/kernels/test_dpbf16.py::test_rows_round_to_bf16_and_meet_the_exact_blocks[q4_1-amx]",
    "tests/gpu/kernels/test_dpbf16.py::test_dense_bf16_rows_on_amx_tiles[shape0-amx]",
    "tests/gpu/test_cpu_attention.py::test_bf16_prefill_kernel_matches_sdpa_on_prompts_and_extensions[amx-9-3-64]",
    "tests/gpu/test_cpu_attention.py::test_bf16_decode_kernel_in_each_isa_build[amx-9-3-64]",
]


def _amx_here() -> bool:
    levels = [i.name for i in native.supported_isas(native.cpu_flags(), native._is_x86())]
    return "amx" in levels and amx_ready("amx")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.skipif(not _amx_here(), reason="needs a CPU with AMX whose OS grants the tiles")
def test_the_amx_kernels_built_without_inlining_pass_their_tests(tmp_path: Path) -> None:
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nexec gcc "$@" -fno-inline\n')
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "ACTORLM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AMX_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{len(AMX_TESTS)} passed" in out.stdout
    assert list((tmp_path / "cache" / "kernels").glob("cpu_prefill-amx-*.so"))  # built here
