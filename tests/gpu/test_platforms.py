"""The platforms' serving decisions: --dtype auto (over fake CPU flag sets), the KV
budget, the default attention backend, refusing what a machine cannot run before any
actor starts, and what they report (the start-up log, ``describe()``)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from actorlm.config import EngineConfig, ModelConfig
from actorlm.gpu.kernels import native
from actorlm.gpu.model_info import load_model_info
from actorlm.gpu.platforms import (
    CpuPlatform,
    CudaPlatform,
    Platform,
    device_platform,
    estimate_weight_bytes,
    resolve_dtype,
)

from .helpers import make_runner
from .kernels.test_native import AVX2_EPYC, ICE_LAKE, SAPPHIRE_RAPIDS, ZEN5

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def config(**model: object) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**model))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_cuda_only_backends_are_refused_on_the_cpu_in_one_line(backend: str) -> None:
    platform = CpuPlatform()
    resolved = platform.adjust_defaults(config(attention_backend=backend))
    with pytest.raises(ValueError, match=f"'{backend}' runs on CUDA devices only") as exc:
        platform.check_config(resolved)
    assert "\n" not in str(exc.value) and "--attention-backend cpu or torch" in str(exc.value)
    platform.check_config(platform.adjust_defaults(config(attention_backend="torch")))


def test_cuda_platform_names_what_to_install() -> None:
    # what check_config asks of CUDA needs no device: an installed module, a 16-bit dtype
    platform = CudaPlatform()
    missing = [n for n in ("flashinfer", "triton") if importlib.util.find_spec(n) is None]
    for name in missing:
        with pytest.raises(ValueError, match=f"'{name}' needs `pip install"):
            platform.check_config(config(device="cuda", dtype="bfloat16", attention_backend=name))
    if "flashinfer" not in missing:
        with pytest.raises(ValueError, match="float16/bfloat16 only"):
            platform.check_config(
                config(device="cuda", dtype="float32", attention_backend="flashinfer")
            )


def test_dtype_auto_and_the_kv_budget_on_the_cpu() -> None:
    platform = CpuPlatform()
    model = platform.adjust_defaults(config()).model
    assert model.dtype == platform.default_dtype() and model.kv_cache_gb == 0
    info = None  # the CPU budget does not look at the model
    assert platform.kv_cache_bytes(model, info) == 2**30  # type: ignore[arg-type]
    half = ModelConfig(kv_cache_gb=0.5)
    assert platform.kv_cache_bytes(half, info) == 2**29  # type: ignore[arg-type]
    # a CPU pool on a CUDA machine is budgeted like the CPU's
    assert CudaPlatform().kv_cache_bytes(ModelConfig(device="cpu"), info) == 2**30  # type: ignore[arg-type]


def test_weight_estimate_counts_a_dense_llama_exactly(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    info = load_model_info(tiny_llama)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    assert estimate_weight_bytes(info, "float32") == hf.num_parameters() * 4
    assert estimate_weight_bytes(info, "bfloat16") == hf.num_parameters() * 2


@pytest.mark.gpu
@needs_cuda
def test_cuda_platform_serving_defaults(tiny_llama: Path) -> None:
    platform = CudaPlatform()
    major, minor = platform.device_capability()
    assert major >= 7 and platform.describe()["capability"] == f"{major}.{minor}"
    assert 0 < platform.free_memory() <= platform.total_memory()
    resolved = platform.adjust_defaults(config())
    model = resolved.model
    assert model.device == "cuda" and model.dtype == ("bfloat16" if major >= 8 else "float16")
    assert model.attention_backend in ("flashinfer", "triton", "torch")
    assert model.cuda_graph_max_bs == min(256, resolved.scheduler.max_running_requests)
    platform.check_config(resolved)
    info = load_model_info(tiny_llama)
    budget = platform.kv_cache_bytes(model, info)
    fraction = platform.kv_cache_bytes(ModelConfig(device="cuda", mem_fraction_static=0.5), info)
    assert 0 < fraction < budget < platform.free_memory()
    fp32 = platform.adjust_defaults(config(dtype="float32")).model
    assert fp32.attention_backend != "flashinfer"  # it runs 16-bit KV only


@pytest.mark.parametrize(
    ("flags", "want", "method"),
    [
        (AVX2_EPYC, "float32", "gguf"),  # bf16 emulated: slower than fp32
        (ICE_LAKE, "float32", "gguf_a8"),  # bf16 emulated, int8 dot products (VNNI)
        (ZEN5, "bfloat16", "gguf"),  # AVX512-BF16
        (SAPPHIRE_RAPIDS, "bfloat16", "gguf"),  # AMX
        (AVX2_EPYC | {"amx_bf16"}, "bfloat16", "gguf"),
    ],
)
def test_auto_runs_the_cpus_fastest_units(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], want: str, method: str
) -> None:
    """bf16 where the CPU has native bf16; int8 rows where its fastest units are
    AVX512-VNNI's; --dtype float32 keeps the exact fp32 path."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.delenv("ACTORLM_ISA", raising=False)
    native.best_isa.cache_clear()
    try:
        platform = CpuPlatform()
        assert platform.default_dtype() == want
        resolved = platform.adjust_defaults(EngineConfig()).model
        assert (resolved.dtype, resolved.quantization) == (want, method)
        pinned = platform.adjust_defaults(EngineConfig(model=ModelConfig(dtype="float32"))).model
        assert (pinned.dtype, pinned.quantization) == ("float32", "gguf")
        chosen = platform.adjust_defaults(EngineConfig(model=ModelConfig(quantization="gguf")))
        assert chosen.model.quantization == "gguf"
        assert platform.describe()["dtype_auto"] == want
    finally:
        native.best_isa.cache_clear()


def test_other_platforms_default_to_fp32() -> None:
    assert Platform().default_dtype() == "float32"
    assert Platform().kernel_isa() == ""


def test_describe_names_the_kernels_isa_and_the_cpu_flags() -> None:
    info = CpuPlatform().describe()
    assert info["kernel_isa"] == native.best_isa().name
    assert set(info["cpu_flags"]) <= native.cpu_flags()
    assert ("avx2" in info["cpu_flags"]) == ("avx2" in native.cpu_flags())
    # an amx build says whether the kernel granted the tiles (else: dot products)
    assert ("amx_tiles" in info) == (native.best_isa().name == "amx")


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


def test_the_cpu_under_a_gpu_platform_runs_as_on_a_cpu_machine(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cpu`` on a GPU machine: the CPU platform's dtype, attention backend and
    kernels, not the active CUDA platform's (whose flashinfer it would then refuse)."""
    from actorlm.extensions import plugins
    from actorlm.launch import resolve_config

    gpu = CudaPlatform()
    monkeypatch.setattr(plugins, "current_platform", lambda: gpu)
    assert device_platform("cuda:1") is gpu and device_platform("") is gpu
    assert isinstance(device_platform("cpu"), CpuPlatform)
    want = CpuPlatform().default_dtype()
    assert resolve_dtype("auto", "cpu") == resolve_dtype("", "") == want
    model = resolve_config(config(path=str(tiny_llama), device="cpu", kv_cache_gb=0.05)).model
    assert (model.device, model.dtype, model.attention_backend) == ("cpu", want, "cpu")
    runner = make_runner(tiny_llama, dtype="auto")
    assert runner.cfg.dtype == want and runner.attention_backend == "cpu"


def test_the_cuda_default_backend_is_triton_then_flashinfer_then_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actorlm.gpu import platforms

    platform, present = CudaPlatform(), set[str]()
    monkeypatch.setattr(platforms, "_imports", lambda module: module in present)
    for capability, modules, want in [
        ((9, 0), {"triton", "flashinfer"}, "triton"),
        ((9, 0), {"flashinfer"}, "flashinfer"),
        ((9, 0), set(), "torch"),
        ((7, 0), {"flashinfer"}, "torch"),  # flashinfer's kernels need sm75
    ]:
        monkeypatch.setattr(CudaPlatform, "device_capability", lambda *a, c=capability: c)
        present.clear()
        present.update(modules)
        assert platform.default_attention_backend() == want
