"""The machine a benchmark ran on, and its limits measured in the same run.

``describe()``: CPU model, cores, the ISA flags that pick kernels and dtypes, torch's
version and threads (recorded in every benchmark's JSON). ``read_bandwidth()``:
bytes/s of a streaming read of a buffer far larger than the caches (filled first:
an untouched buffer reads the zero page and fakes ~10x). ``gemm_flops()``: the best
FLOP/s of torch's GEMM in a dtype over a few prefill-like shapes, including the
model's own (``fp16w`` is fbgemm's fp16-weight GEMM with fp32 activations, what the
``fp16`` and ``gguf`` linear methods run for prefill in float32).

    python bench/machine.py            # prints all of it as JSON
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "ISA_FLAGS",
    "best_dtype",
    "cores",
    "cpu_flags",
    "cpu_pressure",
    "describe",
    "gemm_flops",
    "read_bandwidth",
    "save",
]

# What picks kernels (AVX2, AVX-512), the bf16 dtype (AVX512-BF16, AMX) and int8 paths.
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "neon", "asimd", "sve",
)  # fmt: skip


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def best_dtype() -> str:
    """bf16 where the CPU multiplies it natively (AMX, AVX512-BF16), else fp32: what
    actorlm's and vLLM's CPU back ends choose for themselves."""
    return "bfloat16" if cpu_flags() & {"amx_bf16", "avx512_bf16"} else "float32"


def describe(with_torch: bool = True) -> dict[str, Any]:
    """The CPU (model, cores, ISA flags), memory, and torch's view of it when asked
    (importing torch costs a serving client ~300 MB it does not otherwise need)."""
    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": len(cores()),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError, ValueError):
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    if with_torch:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def cpu_pressure() -> str:
    """Linux PSI: the share of recent time some task waited for a CPU (other load on a
    shared machine), "" where unknown."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""


def _best_s(fn: Callable[[], object], min_s: float, min_runs: int = 3) -> float:
    fn()
    best, spent, n = float("inf"), 0.0, 0
    while spent < min_s or n < min_runs:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def read_bandwidth(mib: int = 512, min_s: float = 0.5) -> float:
    """Bytes/s of the fastest of several full reads (a sum) of a filled ``mib`` buffer."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / _best_s(x.sum, min_s)


def gemm_flops(
    dtype: str, shapes: Iterable[tuple[int, int, int]] = (), min_s: float = 0.3
) -> dict[str, Any]:
    """Best FLOP/s of ``x[M, K] @ w[N, K].T`` in ``dtype`` (float32, bfloat16, fp16w, or
    int8: torch's int8 GEMM, ``torch._int_mm``, ops a second) over ``shapes`` and a 512 x
    2048 x 2048 one; returns the best and each shape's."""
    import torch

    per: dict[str, float] = {}
    for m, n, k in {(512, 2048, 2048), *shapes}:
        if dtype == "fp16w":
            w = torch.ops.quantized.linear_prepack_fp16(torch.randn(n, k), None)
            x = torch.randn(m, k)

            def fn(x: torch.Tensor = x, w: Any = w) -> object:
                return torch.ops.quantized.linear_dynamic_fp16(x, w)
        elif dtype == "int8":
            x8 = torch.randint(-127, 128, (m, k), dtype=torch.int8)
            w8 = torch.randint(-127, 128, (k, n), dtype=torch.int8)

            def fn(x: torch.Tensor = x8, w: torch.Tensor = w8) -> object:
                return torch._int_mm(x, w)
        else:
            t = getattr(torch, dtype)
            x, wd = torch.randn(m, k).to(t), torch.randn(n, k).to(t)

            def fn(x: torch.Tensor = x, w: torch.Tensor = wd) -> object:
                return torch.nn.functional.linear(x, w)

        per[f"{m}x{n}x{k}"] = 2 * m * n * k / _best_s(fn, min_s)
    return {"best": max(per.values()), "shapes": per}


if __name__ == "__main__":
    info = describe()
    info["read_bandwidth_gbs"] = read_bandwidth() / 1e9
    for d in ("float32", "bfloat16", "fp16w"):
        info[f"gemm_{d}_gflops"] = gemm_flops(d)["best"] / 1e9
    print(json.dumps(info, indent=2))


def save(results: object, table: str, out: str | Path) -> None:
    """Raw results to ``out`` (JSON), the printed table beside it (``.md``), and the table."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    path.with_suffix(".md").write_text(table)
    print(table)
