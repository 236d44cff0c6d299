"""The CPU platform's dtype choice (``--dtype auto``) over fake flag sets, and what it
reports: the start-up log and ``describe()`` (the worker's ready info, /get_server_info)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from actorlm.config import EngineConfig, ModelConfig
from actorlm.gpu.kernels import native
from actorlm.gpu.platforms import CpuPlatform, Platform

from .helpers import make_runner
from .kernels.test_native import AVX2_EPYC, SAPPHIRE_RAPIDS, ZEN5


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (AVX2_EPYC, "float32"),  # bf16 emulated: slower than fp32
        (ZEN5, "bfloat16"),  # AVX512-BF16
        (SAPPHIRE_RAPIDS, "bfloat16"),  # AMX
        (AVX2_EPYC | {"amx_bf16"}, "bfloat16"),
    ],
)
def test_auto_is_bf16_where_the_cpu_has_native_bf16(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], want: str
) -> None:
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    platform = CpuPlatform()
    assert platform.default_dtype() == want
    resolved = platform.adjust_defaults(EngineConfig()).model
    assert (resolved.dtype, resolved.quantization) == (want, "gguf")
    pinned = platform.adjust_defaults(EngineConfig(model=ModelConfig(dtype="float32"))).model
    assert pinned.dtype == "float32"
    assert platform.describe()["dtype_auto"] == want


def test_other_platforms_default_to_fp32() -> None:
    assert Platform().default_dtype() == "float32"
    assert Platform().kernel_isa() == ""


def test_describe_names_the_kernels_isa_and_the_cpu_flags() -> None:
    info = CpuPlatform().describe()
    assert info["kernel_isa"] == native.best_isa().name
    assert set(info["cpu_flags"]) <= native.cpu_flags()
    assert ("avx2" in info["cpu_flags"]) == ("avx2" in native.cpu_flags())


def test_the_runner_resolves_auto_and_says_what_runs(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="actorlm.gpu.runner"):
        runner = make_runner(tiny_llama, dtype="auto")
    want = CpuPlatform().default_dtype()
    assert runner.cfg.dtype == runner.info.dtype == want
    assert str(runner.dtype) == f"torch.{want}" and runner.pool.dtype == runner.dtype
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype"))
    assert f"dtype {want}, kernels {native.best_isa().name}" in line
